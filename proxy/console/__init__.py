"""The operator console: static pages served at `/ui` (docs/console.md)."""
