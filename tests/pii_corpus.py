"""A seeded corpus for the redaction tests and the throughput benchmark.

`SEEDED` maps a kind to realistic values (valid checksums where the recognizer validates them);
`seeded_messages()` embeds every value in the places agent traffic carries it: user messages, tool
call arguments, tool results (JSON, shell output, .env and config files, stack traces) and model
output. `BENIGN` is agent text that must come out unchanged.

Token-like values are generated from a fixed seed rather than written out, so the file itself holds
nothing a secret scanner would flag.
"""

from __future__ import annotations

import base64
import json
import random
import string

_rng = random.Random(20240611)
_ALNUM = string.ascii_letters + string.digits
_HEX = "0123456789abcdef"
_B64 = _ALNUM + "+/"


def _r(alphabet: str, n: int) -> str:
    return "".join(_rng.choice(alphabet) for _ in range(n))


def _b64url(obj: dict) -> str:
    return base64.urlsafe_b64encode(json.dumps(obj).encode()).decode().rstrip("=")


_JWT = (
    _b64url({"alg": "HS256", "typ": "JWT"})
    + "."
    + _b64url({"sub": "user_8812", "tenant": "acme", "exp": 1767225600})
    + "."
    + _r(_ALNUM + "-_", 43)
)
_PEM_BODY = "\n".join(_r(_B64, 64) for _ in range(6))
_PEM = "-----BEGIN " + "RSA PRIVATE KEY-----\n" + _PEM_BODY + "\n-----END " + "RSA PRIVATE KEY-----"
_PEM_EC = (
    "-----BEGIN "
    + "EC PRIVATE KEY-----\n"
    + _r(_B64, 64)
    + "\n"
    + _r(_B64, 36)
    + "==\n-----END "
    + "EC PRIVATE KEY-----"
)

SEEDED: dict[str, list[str]] = {
    "EMAIL_ADDRESS": [
        "maria.gonzalez@fastmail.com",
        "j.smith+billing@acme-corp.io",
        "devops@northwind-traders.co.uk",
    ],
    "PHONE_NUMBER": [
        "+1 (415) 555-0132",
        "+44 20 7946 0958",
        "(212) 736-5000",
        "+49 30 901820",
        "+91 98765 43210",
    ],
    "CREDIT_CARD": ["4111 1111 1111 1111", "5500-0000-0000-0004", "378282246310005", "6011111111111117"],
    "US_SSN": ["536-90-4412", "401-23-7788"],
    "IP_ADDRESS": ["203.0.113.57", "198.51.100.23", "10.12.4.201", "2001:db8:85a3::8a2e:370:7334"],
    "IBAN_CODE": ["DE89 3704 0044 0532 0130 00", "GB82WEST12345698765432", "FR1420041010050500013M02606"],
    "API_KEY": [
        "sk-proj-" + _r(_ALNUM, 48),
        "sk-ant-api03-" + _r(_ALNUM + "-_", 93) + "AA",
        "sk-" + _r(_ALNUM, 48),
        "xoxb-" + _r(string.digits, 12) + "-" + _r(string.digits, 13) + "-" + _r(_ALNUM, 24),
        "AIza" + _r(_ALNUM + "-_", 35),
        "sk_" + "live_" + _r(_ALNUM, 24),
        "hf_" + _r(_ALNUM, 34),
    ],
    "AWS_ACCESS_KEY": ["AKIA" + _r(string.ascii_uppercase + "234567", 16), _r(_ALNUM + "+/", 40)],
    "GITHUB_TOKEN": ["ghp_" + _r(_ALNUM, 36), "github_pat_" + _r(_ALNUM, 22) + "_" + _r(_ALNUM, 59)],
    "GITLAB_TOKEN": ["glpat-" + _r(_ALNUM + "-_", 20)],
    "JWT": [_JWT],
    "PRIVATE_KEY": [_PEM, _PEM_EC],
    "URL_CREDENTIALS": [
        "Tr0ub4dor&3x",
        "hunter2pass",
        "r3disP4ss",
        "Gu3stPw9",
        "M0ngoPa55",
        "Sql$erver2022!",
    ],
    "AUTH_HEADER": [
        _r(_HEX, 40),
        base64.b64encode(b"deploy:" + _r(_ALNUM, 14).encode()).decode(),
        _r(_ALNUM, 32),
    ],
    "HIGH_ENTROPY_SECRET": [
        "django-insecure-" + _r(_ALNUM + "!@#%^&*", 40),
        _r(_ALNUM, 36),
        "S3cure!Pass#2024",
        _r(_HEX, 64),
        "correcthorsebattery",
    ],
}

S = SEEDED  # short alias for the templates below


def seeded_messages() -> list[dict]:
    """Chat messages (OpenAI shape) that together hold every seeded value."""
    em, ph, cc, ssn, ip, iban = (
        S[k] for k in ("EMAIL_ADDRESS", "PHONE_NUMBER", "CREDIT_CARD", "US_SSN", "IP_ADDRESS", "IBAN_CODE")
    )
    api, aws, gh, gl = S["API_KEY"], S["AWS_ACCESS_KEY"], S["GITHUB_TOKEN"], S["GITLAB_TOKEN"]
    pw, auth, hi = S["URL_CREDENTIALS"], S["AUTH_HEADER"], S["HIGH_ENTROPY_SECRET"]
    env_file = (
        "# production settings\n"
        f"OPENAI_API_KEY={api[0]}\n"
        f"ANTHROPIC_API_KEY={api[1]}\n"
        f"DATABASE_URL=postgresql://svc_app:{pw[0]}@db-prod.internal:5432/orders\n"
        f"REDIS_URL=redis://:{pw[2]}@cache.internal:6379/0\n"
        f"AWS_ACCESS_KEY_ID={aws[0]}\n"
        f"AWS_SECRET_ACCESS_KEY={aws[1]}\n"
        f"SECRET_KEY={hi[0]}\n"
        f"DB_PASSWORD={hi[4]}\n"
        "DEBUG=false\nPORT=8000\n"
    )
    config_yaml = (
        "server:\n  host: 0.0.0.0\n  port: 8443\n"
        "database:\n"
        f"  url: mysql://root:{pw[1]}@10.0.0.5/shop\n"
        f'  password: "{hi[2]}"\n'
        "broker:\n"
        f"  url: amqp://guest:{pw[3]}@rabbit.internal:5672/\n"
        "mongo:\n"
        f"  uri: mongodb+srv://admin:{pw[4]}@cluster0.abcde.mongodb.net/app?retryWrites=true\n"
        "slack:\n"
        f"  bot_token: {api[3]}\n"
        "sqlserver:\n"
        f'  conn: "Server=tcp:sql01.corp.local,1433;Database=Billing;User ID=sa;Password={pw[5]};"\n'
    )
    shell_output = (
        "$ curl -sv https://api.payments.example.com/v1/charges\n"
        f"> Authorization: Bearer {auth[0]}\n"
        "> User-Agent: curl/8.5.0\n"
        f"> x-api-key: {auth[2]}\n"
        "< HTTP/2 200\n"
        f"$ git remote -v\norigin\thttps://oauth2:{gl[0]}@gitlab.com/acme/infra.git (fetch)\n"
        f"$ cat ~/.ssh/id_rsa\n{S['PRIVATE_KEY'][0]}\n"
        f"$ ip addr\n    inet {ip[2]}/24 brd 10.12.4.255 scope global eth0\n    inet6 {ip[3]}/64 scope global\n"
    )
    stack_trace = (
        "Traceback (most recent call last):\n"
        '  File "/srv/app/billing/charge.py", line 88, in charge\n'
        "    resp = client.charge(card=card_number, amount=amount)\n"
        f"billing.errors.CardDeclined: card {cc[0]} declined for customer {em[1]} (phone {ph[1]})\n"
        f"  request_id=req_8f3a token={hi[1]}\n"
        f'psycopg.OperationalError: connection to server at "{ip[0]}", port 5432 failed\n'
    )
    json_result = json.dumps(
        {
            "customers": [
                {"name": "Maria Gonzalez", "email": em[0], "phone": ph[0], "ssn": ssn[0], "iban": iban[0]},
                {"name": "John Smith", "email": em[1], "phone": ph[2], "ssn": ssn[1], "iban": iban[1]},
            ],
            "payment": {"card": cc[1], "backup_card": cc[2], "last_login_ip": ip[1]},
            "credentials": {"client_secret": hi[1], "api_key": hi[3], "github": gh[0]},
            "headers": {"Authorization": "Basic " + auth[1]},
        },
        indent=2,
    )
    return [
        {"role": "system", "content": "You are a coding agent. Use the tools."},
        {
            "role": "user",
            "content": (
                f"Hi, I'm Maria ({em[0]}, {ph[3]}). Our Stripe key {api[5]} and the Google key "
                f"{api[4]} leaked; rotate them. Refund card {cc[3]} to IBAN {iban[2]}. "
                f"My GitHub token is {gh[1]} and the HF one {api[6]}. Call me on {ph[4]} or at "
                f"{em[2]}. SSN for the form: {ssn[0]}."
            ),
        },
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "bash",
                        "arguments": json.dumps(
                            {
                                "command": f"psql 'postgresql://svc_app:{pw[0]}@db-prod.internal/orders' -c 'select 1'",
                                "env": {"OPENAI_API_KEY": api[2], "JWT": S["JWT"][0]},
                            }
                        ),
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": env_file},
        {"role": "tool", "tool_call_id": "call_2", "content": config_yaml},
        {"role": "tool", "tool_call_id": "call_3", "content": shell_output},
        {"role": "tool", "tool_call_id": "call_4", "content": stack_trace},
        {"role": "tool", "tool_call_id": "call_5", "content": json_result},
        {
            "role": "assistant",
            "content": (
                "I rotated the keys. The old JWT was "
                f"{S['JWT'][0]} and the EC key below is revoked:\n{S['PRIVATE_KEY'][1]}\n"
                f"I emailed {em[2]} and texted {ph[4]}. Server {ip[0]} is patched."
            ),
        },
    ]


BENIGN: list[str] = [
    # code
    'def load(path: str, *, max_tokens: int = 1024) -> dict:\n    token = os.environ["GITHUB_TOKEN"]\n'
    '    password = getpass.getpass()\n    headers = {"Authorization": f"Bearer {token}", "x-api-key": api_key}\n'
    "    return requests.get(url, headers=headers, timeout=30).json()\n",
    "use std::collections::HashMap;\nfn main() { let m: HashMap<u32, String> = HashMap::new(); std::process::exit(0); }\n",
    "for (let i = 0; i < 1000000; i++) { total += arr[i] * 0.5; }  // O(n), 3.14159, 2.71828\n",
    # paths, git, ids, versions
    "M  src/proxy/redaction.py\n?? tests/data/fixtures/2024-06-11/run_000123.json\n/home/dev/.cache/huggingface/hub/models--Qwen--Qwen2.5-0.5B\n",
    "commit 3f2a9c1b7e4d5a6b8c9d0e1f2a3b4c5d6e7f8a9b\nAuthor: Dev Bot <noreply@github.com>\nDate:   Tue Jun 11 10:23:45 2024 +0200\n\n    Fix parser (#4521)\n",
    "session 0190a7c2-5e3b-7d41-9f2a-3c8e6b1d4f70 step 01J0Z8Q4M6X2V3N5P7R9T1W3Y5 request_id=req_8f3a2b1c",
    "presidio-analyzer==2.2.366 spacy>=3.8,<3.9 torch 2.13.0+cpu node v20.11.1 Python 3.11.9 numpy-1.26.4",
    "image: ghcr.io/acme/proxy@sha256:9b2f6c3d4e5a6b7c8d9e0f1a2b3c4d5e6f7a8b9c0d1e2f3a4b5c6d7e8f9a0b1c",
    '"integrity": "sha512-Vx3l1m0a9N2bQf0kJc8pP0nS6hO+1k0mYcS2rYbE8fQ5cX9tJbQ==", "resolved": "https://registry.npmjs.org/lodash/-/lodash-4.17.21.tgz"',
    # ordinary URLs and hosts
    "See https://docs.python.org/3/library/re.html and https://github.com/microsoft/presidio/issues/1234 or http://localhost:8000/v1/models",
    "git clone git@github.com:acme/infra.git && uvicorn app:app --host 0.0.0.0 --port 8000  # binds 127.0.0.1 too",
    # numbers that are not PII
    "========= 42 passed, 3 skipped in 12.34s =========\nreal\t0m1.532s\nepoch 1718094225 loss 0.3421 lr 3e-05 step 1200/5000",
    "Listening on [::]:8080; pid 48213; uptime 3600s; mem 1073741824 bytes; 2024-06-11T10:23:45.123Z",
    '{"model": "qwen2.5-0.5b", "max_tokens": 512, "tokenizer": "Qwen/Qwen2.5-0.5B-Instruct", "temperature": 0.7}',
    "secretName: tls-secret\nsecret: db-credentials\ntoken_type: Bearer\npassword_policy: strong\nauth: enabled",
    "color: #3f2a9c; margin: 0 0 12px; font-size: 14px; width: 1280px; height: 720px",
]
