"""Redaction engine: the planted-secret corpus, each rule, what must survive, and properties."""

from __future__ import annotations

import json
from unittest import mock

import bcrypt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.program.diagnose import redact as redact_module
from agent.program.diagnose.redact import Redactor, marker
from tests.support.redaction import (
    CORPUS_DIR,
    CORPUS_FILES,
    keep_lines,
    openssl_hash,
    planted,
    surviving_secrets,
)

REDACTOR = Redactor()


def redact(text: str) -> str:
    return REDACTOR.redact_text(text)


class TestCorpus:
    """Every planted secret goes; every diagnostic line stays."""

    def test_corpus_is_substantial(self) -> None:
        assert len(planted()) >= 40
        assert len((CORPUS_DIR / "train.log").read_text().splitlines()) >= 250

    def test_planted_secrets_are_in_the_raw_corpus(self) -> None:
        raw = [(CORPUS_DIR / name).read_text() for name in CORPUS_FILES]
        assert surviving_secrets(raw) == planted()

    def test_no_planted_secret_survives(self) -> None:
        redacted = [redact((CORPUS_DIR / name).read_text()) for name in CORPUS_FILES]
        assert surviving_secrets(redacted) == []

    def test_diagnostic_lines_survive(self) -> None:
        redacted = "\n".join(redact((CORPUS_DIR / name).read_text()) for name in CORPUS_FILES)
        lost = [line for line in keep_lines() if line not in redacted]
        assert lost == []

    def test_every_kind_is_counted(self) -> None:
        counts = REDACTOR.redact("\n".join((CORPUS_DIR / n).read_text() for n in CORPUS_FILES))[1]
        for kind in (
            "aws_access_key_id",
            "github_token",
            "huggingface_token",
            "openai_key",
            "anthropic_key",
            "private_key",
            "email",
            "prompt",
            "url_password",
            "jwt",
            "azure_key",
            "azure_sas",
            "slack_token",
            "stripe_key",
            "pypi_token",
            "npm_token",
            "docker_token",
            "secret_value",
            "wandb_key",
        ):
            assert counts[kind] >= 1, kind


TOKENS = [
    ("aws_access_key_id", "key AKIAIOSFODNN7EXAMPLQ in use", "AKIAIOSFODNN7EXAMPLQ"),
    ("github_token", "ghp_" + "a1B2" * 9, "ghp_" + "a1B2" * 9),
    (
        "github_token",
        "x github_pat_11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyz0123 y",
        "github_pat_11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyz0123",
    ),
    ("gitlab_token", "glpat-abcdefghij0123456789", "glpat-abcdefghij0123456789"),
    (
        "huggingface_token",
        "token=hf_abcdefghijklmnopqrstuvwxyzABCDEFGH",
        "hf_abcdefghijklmnopqrstuvwxyzABCDEFGH",
    ),
    (
        "openai_key",
        "sk-proj-Abcdefghij0123456789abcdefghij",
        "sk-proj-Abcdefghij0123456789abcdefghij",
    ),
    (
        "anthropic_key",
        "sk-ant-api03-Abcdefghij0123456789abcdef",
        "sk-ant-api03-Abcdefghij0123456789abcdef",
    ),
    ("slack_token", "xoxp-1234567890-abcdefghij", "xoxp-1234567890-abcdefghij"),
    ("stripe_key", "sk_live_abcdefghij0123456789", "sk_live_abcdefghij0123456789"),
    ("pypi_token", "pypi-" + "A" * 60, "pypi-" + "A" * 60),
    ("npm_token", "npm_" + "b" * 36, "npm_" + "b" * 36),
    ("docker_token", "dckr_pat_abcdefghijklmnopqrstu", "dckr_pat_abcdefghijklmnopqrstu"),
    ("jwt", "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0In0.c2lnbmF0dXJlMTIz", "eyJzdWIiOiIxMjM0In0"),
    ("url_password", "amqp://guest:s3cr3tpw@rabbit:5672/", "s3cr3tpw"),
    ("bearer_token", "Authorization: Bearer abcdef0123456789", "abcdef0123456789"),
    ("secret_value", 'cfg = {"password": "swordfish"}', "swordfish"),
    ("secret_value", "client_secret: 'opensesame'", "opensesame"),
    ("secret_value", "export DB_PASSWORD=letmein99", "letmein99"),
    ("secret_value", "apiKey = abcd1234efgh", "abcd1234efgh"),
    ("secret_value", "pin_password: 4711093", "4711093"),
    ("cli_secret", "app --api-key=deadbeefcafe run", "deadbeefcafe"),
    ("email", "mail ops@example.com now", "ops@example.com"),
    (
        "private_key",
        "-----BEGIN RSA PRIVATE KEY-----\nMIIabc\n-----END RSA PRIVATE KEY-----",
        "MIIabc",
    ),
    ("private_key", "-----BEGIN PRIVATE KEY-----\nMIIcutoff\nMIImore", "MIImore"),
]


class TestRules:
    """Each kind of secret is found in its usual form and replaced by its marker."""

    @pytest.mark.parametrize(("kind", "text", "secret"), TOKENS)
    def test_removed_and_marked(self, kind: str, text: str, secret: str) -> None:
        out, counts = REDACTOR.redact(text)
        assert secret not in out
        assert counts[kind] >= 1

    def test_known_literal_secrets_are_removed_anywhere(self) -> None:
        redactor = Redactor(extra_literals=("broker-pw-Zq81", "abc"))
        out, counts = redactor.redact("connect failed, pw broker-pw-Zq81 rejected; abc stays")
        assert "broker-pw-Zq81" not in out
        assert "abc stays" in out  # too short to be replaced everywhere
        assert counts["known_secret"] == 1

    def test_marker_format(self) -> None:
        assert redact("ghp_" + "x" * 36) == marker("github_token")


# Review findings: each of these leaked the secret (or part of it) before.
LEAKS = [
    ("password: my secret phrase", "secret phrase"),
    ("db_password = super secret phrase", "secret phrase"),
    ("TOKEN=ab cd", "cd"),
    ("client_secret=abc;def", "def"),
    ("curl -u admin:S3cretPass https://x", "S3cretPass"),
    ("curl --user=admin:S3cretPass https://x", "S3cretPass"),
    ("mysql -u root -pS3cretPass metrics", "S3cretPass"),
    ("mysqldump -h db -pS3cretPass metrics", "S3cretPass"),
    ("mysql --password=S3cretPass", "S3cretPass"),
    ("mysql --password S3cretPass", "S3cretPass"),
    ("DB_PASS=hunter22xyz", "hunter22xyz"),
    ("DB_PASS: hunter22xyz", "hunter22xyz"),
    ("MQTT_PASS=hunter22xyz", "hunter22xyz"),
    ("pass=hunter22xyz", "hunter22xyz"),
    ("pwd=hunter22xyz", "hunter22xyz"),
    ("mqtt.pwd: hunter22xyz", "hunter22xyz"),
    ("SECRET_KEY_BASE=abcdef123456789", "abcdef123456789"),
    ('password = "hunter22"\npassword2 = "zzzzzz22"', "zzzzzz22"),
    ("    client-key-data: LS0tLS1CRUdJTiBSU0EgUFJJVkFURSBLRVktLS0tLQpNSUlF", "LS0tLS1CRUdJTi"),
    ("    client-certificate-data: LS0tLS1CRUdJTiBDRVJUSUZJQ0FURS0tLS0t", "LS0tLS1CRUdJTi"),
    ("    token: abcdef0123456789abcdef", "abcdef0123456789abcdef"),
    ("DATABASE_URL=postgres://user:p@ss@host/db", "ss@"),
    ("PASSWORD := hunter22", "hunter22"),
    ('password => "hunter22"', "hunter22"),
    ("<password>hunter22</password>", "hunter22"),
    ("<db.password>hunter22</db.password>", "hunter22"),
    ("PASSWORD=(hunter22)", "hunter22"),
    ('password="hunter22 and more', "hunter22"),
    ("-----BEGIN RSA PRIVATE KEY-----\nMIIcut", "MIIcut"),
    (
        "MIIEvQIBADANBgkqhkiG9w0BAQEF\nVJTUt9Us8cKjMzEfYyjiWA4R4\n-----END PRIVATE KEY-----\n",
        "VJTUt9Us8cKjMzEfYyjiWA4R4",
    ),
]


class TestReviewLeaks:
    """Values that used to survive in part: whole values, new key names, CLI forms, PEM tails."""

    @pytest.mark.parametrize(("text", "secret"), LEAKS)
    def test_secret_removed(self, text: str, secret: str) -> None:
        assert secret not in redact(text)

    def test_multi_word_value_stops_at_the_next_pair(self) -> None:
        assert redact("use_auth_token=abcdef123456 push_to_hub=false") == (
            "use_auth_token=[REDACTED:secret_value] push_to_hub=false"
        )

    def test_unterminated_quote_keeps_its_quote(self) -> None:
        assert redact('password="hunter22') == 'password="[REDACTED:secret_value]'

    def test_json_comma_ends_a_value(self) -> None:
        assert redact('{"token": 2, "n": 3}') == '{"token": 2, "n": 3}'


KEEP = [
    "NVRM: Xid (PCI:0000:3b:00): 79, pid=3121, name=python, GPU has fallen off the bus.",
    "step=120 loss=1.9342 lr=2.000e-05 grad_norm=1.022 tokens_per_sec=42011",
    "RuntimeError: CUDA error: an illegal memory access was encountered",
    "frame #0: c10::Error::Error + 0x96 (0x7f3a1c2b8f86 in /opt/conda/lib/libc10.so)",
    "uuid=GPU-5f1c2a3e-8b9d-4c7e-a1f2-3b4c5d6e7f80 pci=00000000:3B:00.0",
    "NCCL WARN NET/IB : Got completion from peer 10.12.0.18<59122> with status=12",
    "tokenizer: pad_token=<pad> eos_token=</s> max_tokens=4096 num_tokens=77",
    'password_file = "/etc/gpuwarden/mqtt-password"',
    "use_auth_token=True push_to_hub=false",
    '{"max_tokens": 256, "usage": {"prompt_tokens": 61}}',
    "torchrun --nproc_per_node=8 train.py --max-new-tokens 512",
    "http://127.0.0.1:9445/metrics and mqtt://broker.internal:1883",
    '{"by_kind": {"aws_access_key_id": 2, "secret_value": 14}, "total": 16}',
    '{"collectors": {"system": {"proc_root": "/proc", "interval": 15.0}}}',
    "Saving checkpoint to /mnt/ckpt/run-17/global_step240/mp_rank_00_model_states.pt",
    "bypass=true compass=north surpass: yes",
    "PWD=/home/trainer/runs/llama-8b-sft",
    "docker run -u 1000:1000 --gpus all img",
    "mysql -u root -P 3306 -h db.internal metrics",
    "gpu-host-17:3121:3190 [0] NCCL INFO -----END OF RING-----",
]


class TestDiagnosticsSurvive:
    """What support needs is never mistaken for a secret."""

    @pytest.mark.parametrize("line", KEEP)
    def test_line_unchanged(self, line: str) -> None:
        assert redact(line) == line


class TestPrompts:
    """Prompt and completion text goes; structure and lengths stay."""

    def test_messages_content_blanked_structure_kept(self) -> None:
        record = {
            "model": "m",
            "messages": [{"role": "user", "content": "tell me a secret"}],
            "max_tokens": 5,
        }
        out = json.loads(redact(json.dumps(record)))
        assert out["messages"][0]["role"] == "user"
        assert out["messages"][0]["content"] == "[REDACTED:prompt:16 chars]"
        assert out["max_tokens"] == 5

    def test_content_parts_and_token_ids(self) -> None:
        record = {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hello there"}]}],
            "input": [101, 2023, 102],
        }
        out = json.loads(redact(json.dumps(record)))
        assert out["messages"][0]["content"] == [
            {"type": "text", "text": "[REDACTED:prompt:11 chars]"}
        ]
        assert out["input"] == "[REDACTED:prompt:3 items]"

    def test_prefixed_log_line(self) -> None:
        line = 'INFO req {"prompt": "my diary", "n": 1} done\n'
        assert redact(line) == 'INFO req {"prompt": "[REDACTED:prompt:8 chars]", "n": 1} done\n'

    def test_pretty_printed_document(self) -> None:
        doc = json.dumps({"system": "be terse", "id": 3}, indent=4)
        out = json.loads(redact(doc))
        assert out == {"system": "[REDACTED:prompt:8 chars]", "id": 3}

    def test_truncated_json_line(self) -> None:
        line = '{"messages": [{"role": "user", "content": "private words"}, {"ro'
        assert "private words" not in redact(line)

    def test_content_outside_conversation_stays(self) -> None:
        line = '{"content": "checkpoint saved", "path": "/mnt/x"}'
        assert redact(line) == line


TEXT = st.text(alphabet=st.characters(codec="utf-8"), max_size=400) | st.lists(
    st.sampled_from(
        [
            "password=",
            "token: ",
            '"prompt": "',
            '"messages": [',
            "{",
            "}",
            "]",
            '"',
            "'",
            " ",
            "\n",
            "ghp_",
            "a" * 36,
            "@",
            "example.com",
            "://",
            "user:",
            "pw@",
            "Bearer ",
            "[REDACTED:x]",
            "-----BEGIN PRIVATE KEY-----",
            "-----END PRIVATE KEY-----",
            "sk-",
            "eyJ",
            ".",
            "AKIA",
            "ABCDEFGHIJKLMNOP",
            "hf_",
            "content",
            '"content": "',
            "=",
            ":",
            ",",
            "--token ",
            "wandb login ",
            "0123456789abcdef0123456789abcdef01234567",
            "sig=",
            "&",
            "AccountKey=",
            ";",
            "$6$",
            "$2b$12$",
            "$y$j9T$",
            "$argon2id$v=19$m=65536,t=3,p=4$",
            "$",
            "abcdefghijklmnopqrstuvwxyz./0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789",
        ]
    ),
    max_size=40,
).map("".join)


class TestProperties:
    """Redaction never crashes, and redacting twice changes nothing."""

    @settings(max_examples=400, deadline=None)
    @given(TEXT)
    def test_idempotent(self, text: str) -> None:
        once = redact(text)
        assert redact(once) == once

    @settings(max_examples=300, deadline=None)
    @given(TEXT)
    def test_line_windows_change_nothing(self, text: str) -> None:
        # Rules run only on lines holding their hints (for speed); on the whole text they
        # must give the same result.
        whole = mock.patch.multiple(
            redact_module,
            _hint_spans=lambda t, rule: [(0, len(t))],
            _key_value_lines=lambda t: [(0, len(t))],
        )
        with whole:
            reference = redact(text)
        assert redact(text) == reference

    @settings(max_examples=200, deadline=None)
    @given(
        st.text(alphabet=" \n=:;,abcXYZ019._-", max_size=60),
        st.text(alphabet=" \n=:;,abcXYZ019._-", max_size=60),
    )
    def test_embedded_token_always_removed(self, before: str, after: str) -> None:
        token = "ghp_" + "Q7" * 18
        assert token not in redact(f"{before} {token} {after}")


def password_hashes() -> list[tuple[str, str]]:
    """(scheme, hash) of every format /etc/shadow, htpasswd and web-config files carry."""
    made = [(scheme, openssl_hash(scheme, "hunter22")) for scheme in ("1", "5", "6", "apr1")]
    made += [
        (prefix, bcrypt.hashpw(b"hunter22", bcrypt.gensalt(4, prefix=prefix.encode())).decode())
        for prefix in ("2a", "2b")
    ]
    # No tool here writes these; the strings are libxcrypt's crypt() output (yescrypt, gost
    # yescrypt, scrypt, sha512crypt with rounds) and the PHC format of argon2's reference code.
    literal = [
        ("2y", "$2y$10$" + "N9qo8uLOickgx2ZMRZoMyeIjZAgcfl7p92ldGxad68LJZdL17lhWy"),
        ("y", "$y$j9T$abcd$m4rN8yJJ4tdD.J1IY61EvCGMH3ULkDSqWJ8omMKRyl0"),
        ("7", "$7$CU..../....abcdefghij$29F8itvnVvBDjrxBwmqvA3zIcoWdi4Mb8U3QftXksR7"),
        (
            "6 rounds",
            "$6$rounds=5000$abcdefgh$KQeXafAQAaOoKTevphVU215RvJdgzyfASRasIOuh12hO8u0r1bGW92Z"
            "nTmC9IjsiQ8VPiTXBiZF49dFL1U4wX/",
        ),
        (
            "argon2id",
            "$argon2id$v=19$m=65536,t=3,p=4$c29tZXNhbHRzb21lc2FsdA$"
            "RdescudvJCsgt3ub+b+dWRWJTmaaJObG",
        ),
        (
            "argon2i",
            "$argon2i$v=19$m=4096,t=3,p=1$c29tZXNhbHQ$iWh06vD8Fy27wf9npn6FXWiCX4K6pW6Ue1Bnzz07Z8A",
        ),
    ]
    return made + literal


HASHES = password_hashes()


class TestPasswordHashes:
    """A password hash is a password to whoever runs a cracker: it never leaves in a bundle,
    in a shadow line, an htpasswd line, a users file or a web-config.yml."""

    @pytest.mark.parametrize(("scheme", "hashed"), HASHES, ids=[s for s, _ in HASHES])
    @pytest.mark.parametrize(
        "template",
        [
            "root:{h}:19700:0:99999:7:::",  # /etc/shadow
            "prometheus:{h}",  # htpasswd, the agent's users file
            "  prometheus: {h}",  # web-config.yml basic_auth_users
            '  prometheus: "{h}"',
            "usermod -p '{h}' trainer",
            "hash={h} rest",
            "{h}",
        ],
    )
    def test_hash_removed_wherever_it_stands(self, scheme: str, hashed: str, template: str) -> None:
        out, counts = REDACTOR.redact(template.format(h=hashed))
        # Neither the whole hash nor its digest part (after the last $) survives.
        assert hashed not in out
        assert hashed.rsplit("$", 1)[1] not in out
        assert sum(counts.values()) >= 1

    def test_user_name_and_shadow_fields_stay(self) -> None:
        """The account and the aging fields are what support reads; only the hash goes."""
        hashed = openssl_hash("6", "hunter22")
        out, counts = REDACTOR.redact(f"root:{hashed}:19700:0:99999:7:::")
        assert out == f"root:{marker('password_hash')}:19700:0:99999:7:::"
        assert counts["password_hash"] == 1

    @pytest.mark.parametrize(
        "line",
        [
            "awk '{print $1$2}' file",
            "echo $1$HOME$PATH",
            "root:*:19700:0:99999:7:::",
            "trainer:!:19700::::::",
            "price $5$ per GPU-hour",
        ],
    )
    def test_dollar_words_that_are_no_hash_stay(self, line: str) -> None:
        assert redact(line) == line
