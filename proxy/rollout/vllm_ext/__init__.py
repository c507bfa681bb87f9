"""Code that runs inside vLLM's API server (not imported by the proxy): see atdp_update.py."""
