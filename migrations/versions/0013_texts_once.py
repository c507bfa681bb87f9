"""texts once: message and output bodies refer to their long strings (proxy/store/texts.py)

Revision ID: 0013
Revises: 0012
A tool result was stored as its own content and again inside the tool message; a model's text in
the action (`text` and the native `output` message) and again in the assistant message the agent
echoes. From this revision the writer stores a string of 256+ characters of a `message` or `output`
body as a reference (U+E000 "@" hash) to a `contents` row holding that string (kind `text`, or the
tool result / system prompt row that is the same string), and an output's native message as a
reference to a `message` row (the one the agent's echo of it refers to, when it is the same). `atdp_content(tenant, kind, body)` reads a
stored body back as written; `atdp_steps_readable` reads outputs through it (same columns).

Existing rows keep their whole bodies (they read the same: the writer's keyed hashes cannot be
recomputed here without the deployment secret); only a stored string that happens to start with
U+E000 is escaped, so it is not read as a reference. Downgrade writes references back in place.
"""

from collections.abc import Sequence
from importlib.util import module_from_spec, spec_from_file_location
from pathlib import Path

from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ENCODED = "('message', 'output')"

# A body of an encoded kind, as written: "\ue000@<hash>" -> that row's body, read the same way (JSON
# null when gone),
# "\ue000<s>" -> "<s>" (an escaped string). Bodies without U+E000 anywhere are returned untouched
# (one strpos on the text form: most rows).
CONTENT_FN = r"""
CREATE OR REPLACE FUNCTION atdp_content(tenant text, kind text, body jsonb) RETURNS jsonb
LANGUAGE plpgsql STABLE AS $fn$
DECLARE s text;
BEGIN
    IF body IS NULL OR kind NOT IN ('message', 'output') OR strpos(body::text, chr(57344)) = 0 THEN
        RETURN body;
    END IF;
    CASE jsonb_typeof(body)
    WHEN 'string' THEN
        s := body #>> '{}';
        IF left(s, 1) <> chr(57344) THEN
            RETURN body;
        ELSIF substr(s, 2, 1) = '@' THEN
            RETURN coalesce((SELECT atdp_content(c.tenant_id, c.kind, c.body) FROM contents c
                              WHERE c.tenant_id = tenant AND c.hash = substr(s, 3)), 'null'::jsonb);
        END IF;
        RETURN to_jsonb(substr(s, 2));
    WHEN 'object' THEN
        RETURN (SELECT coalesce(jsonb_object_agg(e.key, atdp_content(tenant, kind, e.value)), '{}'::jsonb)
                  FROM jsonb_each(body) AS e);
    WHEN 'array' THEN
        RETURN (SELECT coalesce(jsonb_agg(atdp_content(tenant, kind, a.v) ORDER BY a.i), '[]'::jsonb)
                  FROM jsonb_array_elements(body) WITH ORDINALITY AS a(v, i));
    ELSE
        RETURN body;
    END CASE;
END
$fn$
"""

# Upgrade only: a string that starts with U+E000 gets one more in front (the escape).
ESCAPE_FN = r"""
CREATE FUNCTION atdp_escape_0013(body jsonb) RETURNS jsonb LANGUAGE sql IMMUTABLE AS $fn$
SELECT CASE jsonb_typeof(body)
    WHEN 'string' THEN CASE WHEN left(body #>> '{}', 1) = chr(57344) THEN to_jsonb(chr(57344) || (body #>> '{}'))
                            ELSE body END
    WHEN 'object' THEN (SELECT coalesce(jsonb_object_agg(e.key, atdp_escape_0013(e.value)), '{}'::jsonb)
                          FROM jsonb_each(body) AS e)
    WHEN 'array' THEN (SELECT coalesce(jsonb_agg(atdp_escape_0013(a.v) ORDER BY a.i), '[]'::jsonb)
                         FROM jsonb_array_elements(body) WITH ORDINALITY AS a(v, i))
    ELSE body END
$fn$
"""

STEPS_READABLE_OUTPUT = (
    "LEFT JOIN contents o ON o.tenant_id = st.tenant_id AND o.hash = st.output_hash",
    "LEFT JOIN LATERAL (SELECT atdp_content(c.tenant_id, c.kind, c.body) AS body FROM contents c\n"
    "                    WHERE c.tenant_id = st.tenant_id AND c.hash = st.output_hash) o ON true",
)


def _view_0002() -> str:
    """The view as 0002 created it (its columns are the public interface: kept, in order)."""
    spec = spec_from_file_location("atdp_migration_0002", Path(__file__).with_name("0002_audit_views.py"))
    module = module_from_spec(spec)
    spec.loader.exec_module(module)
    return dict(module.VIEWS)["atdp_steps_readable"]


def upgrade() -> None:
    op.execute(CONTENT_FN)
    op.execute(ESCAPE_FN)
    op.execute(f"UPDATE contents SET body = atdp_escape_0013(body) WHERE kind IN {ENCODED} "
               "AND strpos(body::text, chr(57344)) > 0")
    op.execute("DROP FUNCTION atdp_escape_0013(jsonb)")
    old, new = STEPS_READABLE_OUTPUT
    view = _view_0002()
    assert old in view
    op.execute(f"CREATE OR REPLACE VIEW atdp_steps_readable AS {view.replace(old, new)}")


def downgrade() -> None:
    op.execute(f"UPDATE contents SET body = atdp_content(tenant_id, kind, body) WHERE kind IN {ENCODED} "
               "AND strpos(body::text, chr(57344)) > 0")
    # Rows only bodies referred to (texts, outputs' native messages no step echoed): a tool result,
    # system prompt or message a step refers to stays.
    op.execute("DELETE FROM contents c WHERE c.kind IN ('text', 'message') "
               "AND NOT EXISTS (SELECT 1 FROM steps st WHERE st.tenant_id = c.tenant_id AND ("
               "  st.system_hash = c.hash OR st.tools_hash = c.hash OR st.output_hash = c.hash"
               "  OR c.hash = ANY(st.message_hashes))) "
               "AND NOT EXISTS (SELECT 1 FROM tool_calls tc WHERE tc.tenant_id = c.tenant_id AND tc.result_hash = c.hash)")
    op.execute(f"CREATE OR REPLACE VIEW atdp_steps_readable AS {_view_0002()}")
    op.execute("DROP FUNCTION atdp_content(text, text, jsonb)")
