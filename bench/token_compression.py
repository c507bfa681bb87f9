"""How PostgreSQL's TOAST compresses real token ids, pglz against lz4.

bench/storage.py draws random ids (incompressible), so it cannot say what compression does to real
ones. This tokenizes the same kind of agent text (bench/redaction_throughput.py's generators: code,
shell output, JSON, prose) with a real tokenizer and stores each step-sized array in an `integer[]`
column of a row over 2 KB (as a step row with a few hundred new prompt ids is), once per method.

  python bench/token_compression.py [--tokenizer ~/.cache/atdp/models/smollm2-135m-instruct-v3/tokenizer.json]
      [--database-url postgresql://postgres@127.0.0.1:5432/postgres] [--arrays 300]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--database-url", default=os.environ.get("ATDP_TEST_DATABASE_URL",
                                                             "postgresql://postgres@127.0.0.1:5432/postgres"))
    ap.add_argument("--tokenizer", default=str(Path.home() / ".cache/atdp/models/smollm2-135m-instruct-v3/tokenizer.json"))
    ap.add_argument("--arrays", type=int, default=300)
    ap.add_argument("--seed", type=int, default=11)
    args = ap.parse_args()

    import psycopg
    from redaction_throughput import code, json_blob, prose, shell
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(args.tokenizer)
    rng = random.Random(args.seed)
    arrays = [tok.encode((code, shell, json_blob, prose)[i % 4](rng, rng.randint(600, 1600)) + prose(rng, 150)).ids
              for i in range(args.arrays)]
    with psycopg.connect(args.database_url, autocommit=True) as c:
        for method in ("pglz", "lz4"):
            c.execute("DROP TABLE IF EXISTS atdp_token_compression")
            c.execute(f"CREATE TEMP TABLE atdp_token_compression (filler text, ids integer[] COMPRESSION {method})")
            for a in arrays:  # 700 bytes of other columns: the row passes 2 KB, so TOAST compresses
                c.execute("INSERT INTO atdp_token_compression VALUES (repeat('x', 700), %s)", (a,))
            raw, stored, n = c.execute("SELECT sum(4 * cardinality(ids) + 24), sum(pg_column_size(ids)), "
                                       "avg(cardinality(ids)) FROM atdp_token_compression").fetchone()
            print(f"{method}: {len(arrays)} arrays of {float(n):.0f} ids on average; {raw / 1024:.1f} KB as stored "
                  f"uncompressed, {stored / 1024:.1f} KB compressed ({stored / raw:.2f}; "
                  f"{4 * stored / (raw - 24 * len(arrays)):.2f} bytes per id)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
