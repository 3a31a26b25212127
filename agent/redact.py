"""Redaction: secrets, personal data and prompt text out of anything that goes into a bundle.

A diagnostic bundle leaves the machine (a support ticket, a chat), so every byte of it goes
through `Redactor.redact` first. What is removed: cloud and hub credentials by their published
prefixes (AWS AKIA/ASIA, GitHub ghp_/github_pat_, GitLab glpat-, Hugging Face hf_, OpenAI sk-,
Anthropic sk-ant-, Slack xox*, Stripe sk_live_, npm_, pypi-, dckr_pat_, Google AIza),
contextual secrets (key=value and "key": "value" forms whose key names a secret, Authorization
headers, passwords in URLs, Azure connection strings and SAS signatures, netrc and CLI flags),
PEM private keys, JWTs, e-mail addresses, and the text of prompts and completions in JSON
request logs (structure and lengths stay, content goes).

What stays, on purpose: error messages, step and loss values, CUDA and NCCL errors, Xid lines,
hex addresses, UUIDs, PCI ids and file paths: support needs them, and none of them is a secret.

Every replacement is a marker `[REDACTED:<kind>]` (prompts: `[REDACTED:prompt:<n> chars]`) that
no rule matches again, and `redact` runs its rules to a fixed point, so redacting twice changes
nothing. The report counts replacements by kind and never holds a value.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Final

MARKER_PREFIX: Final = "[REDACTED:"
_MARKER = re.compile(r"\[REDACTED:[a-z0-9_]+(?::\d+ (?:chars|items))?\]")
MAX_PASSES: Final = 4


def marker(kind: str) -> str:
    return f"{MARKER_PREFIX}{kind}]"


def _is_marker(text: str) -> bool:
    return _MARKER.fullmatch(text) is not None


@dataclass(frozen=True)
class Rule:
    """One pattern. `group` is the part replaced (0: the whole match)."""

    kind: str
    pattern: re.Pattern[str]
    group: int = 0


def _rule(kind: str, pattern: str, group: int = 0, flags: int = 0) -> Rule:
    return Rule(kind, re.compile(pattern, flags), group)


# Key names whose value is a secret. A key must END with one of these words, so that
# `max_tokens`, `tokenizer` or `author` stay, and tokenizer settings (`pad_token`) are not
# mistaken for credentials.
_SECRET_KEY_WORDS = "|".join((  # key names, not passwords
    r"passwd", r"password", r"passphrase", r"secrets?", r"token", r"api[_-]?key", r"apikey",
    r"access[_-]?key(?:[_-]?id)?", r"secret[_-]?key", r"private[_-]?key(?:[_-]?id)?", r"auth",
    r"authorization", r"credentials?", r"cookie", r"session[_-]?id", r"signature",
    r"client[_-]?secret",
))
_NOT_SECRET_KEYS = re.compile(
    r"(?i)(?:^|[_.-])(?:pad|eos|bos|unk|sep|cls|mask|special|start|end|max|num|n)[_-]?tokens?$"
)
_VALUE = r"""(?:\[REDACTED:[^\]\s]*\]|"(?:[^"\\\n]|\\.)*"|'[^'\n]*'|(?![{\[(])[^\s"',;}\]\)]+)"""
_KEY_VALUE = re.compile(
    rf"""(?ix)
    (?P<key>(?<![A-Za-z0-9_])[A-Za-z0-9_.-]*?(?:{_SECRET_KEY_WORDS}))(?![A-Za-z0-9])
    (?P<sep>["']?\s*(?:=|:(?!//))\s*(?:(?:bearer|basic|token|digest)\s+)?)
    (?P<value>{_VALUE})
    """
)
_HARMLESS_VALUES = frozenset({"", "true", "false", "none", "null", "nil", "yes", "no"})
# Short numbers after a secret-sounding key are counts and flags (`"access_key_id": 2` in a
# redaction report, `auth: 0`), not secrets; a numeric password of six digits or more still goes.
_SHORT_NUMBER = re.compile(r"-?\d{1,5}(?:\.\d+)?")

# Prefixed tokens: the prefixes are the vendors' published formats.
TOKEN_RULES: Final[tuple[Rule, ...]] = (
    _rule(
        "private_key",
        r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY( BLOCK)?-----"
        # An unterminated block (a cut-off log) goes to the end of its base64 lines.
        r"(?:.*?-----END [A-Z0-9 ]*PRIVATE KEY( BLOCK)?-----|[^\n]*(?:\n[A-Za-z0-9+/=]+)*)",
        flags=re.DOTALL,
    ),
    _rule("aws_access_key_id", r"(?<![A-Za-z0-9])(?:AKIA|ASIA|AGPA|AIDA|AROA|ANPA|AIPA)[A-Z0-9]{16}(?![A-Za-z0-9])"),
    _rule("github_token", r"(?<![A-Za-z0-9_])(?:ghp|gho|ghu|ghs|ghr)_[A-Za-z0-9]{30,255}"),
    _rule("github_token", r"(?<![A-Za-z0-9_])github_pat_[A-Za-z0-9_]{22,255}"),
    _rule("gitlab_token", r"(?<![A-Za-z0-9_])gl(?:pat|dt|rt|cbt|ptt)-[A-Za-z0-9_-]{20,}"),
    _rule("huggingface_token", r"(?<![A-Za-z0-9_])(?:hf|api_org)_[A-Za-z0-9]{30,}"),
    _rule("anthropic_key", r"(?<![A-Za-z0-9_-])sk-ant-[A-Za-z0-9_-]{20,}"),
    _rule("openai_key", r"(?<![A-Za-z0-9_-])sk-(?:proj-|svcacct-|admin-)?[A-Za-z0-9_-]{20,}"),
    _rule("slack_token", r"(?<![A-Za-z0-9_])xox[abposre]-[A-Za-z0-9-]{10,}"),
    _rule("slack_webhook", r"https://hooks\.slack\.com/(?:services|workflows)/[A-Za-z0-9/_-]+"),
    _rule("stripe_key", r"(?<![A-Za-z0-9_])(?:sk|rk|pk)_(?:live|test)_[A-Za-z0-9]{16,}"),
    _rule("npm_token", r"(?<![A-Za-z0-9_])npm_[A-Za-z0-9]{36}"),
    _rule("pypi_token", r"(?<![A-Za-z0-9_])pypi-[A-Za-z0-9_-]{40,}"),
    _rule("docker_token", r"(?<![A-Za-z0-9_])dckr_pat_[A-Za-z0-9_-]{20,}"),
    _rule("google_api_key", r"(?<![A-Za-z0-9_])AIza[0-9A-Za-z_-]{35}"),
    _rule("google_oauth_token", r"(?<![A-Za-z0-9_])ya29\.[0-9A-Za-z_-]{20,}"),
    _rule("jwt", r"(?<![A-Za-z0-9_-])eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"),
)

CONTEXT_RULES: Final[tuple[Rule, ...]] = (
    # Azure storage / service bus connection strings and SAS tokens.
    _rule("azure_key", r"(?i)(?:AccountKey|SharedAccessKey|SharedAccessSignature)=([^;\s\"'<>]+)", 1),
    _rule("azure_sas", r"(?i)[?&]sig=([^&\s\"'<>]+)", 1),
    # scheme://user:password@host — the user name stays (it says which account), the password goes.
    _rule("url_password", r"(?i)\b[a-z][a-z0-9+.-]*://[^/\s:@\"']*:([^/\s@\"']+)@", 1),
    _rule("bearer_token", r"(?i)\bbearer\s+([A-Za-z0-9._~+/=-]{8,})", 1),
    # W&B keys are 40 hex digits; `wandb login KEY` ends up in shell histories.
    _rule("wandb_key", r"(?i)\bwandb\s+login\s+(?:--\S+\s+)*([0-9a-f]{40})\b", 1),
    # netrc: machine HOST login USER password SECRET (one line, or one key per line).
    _rule("netrc_password", r"(?im)(?:^|\s)password\s+(?!is\b|for\b|was\b|to\b)([^\s'\"]+)\s*$", 1),
    _rule("netrc_password", r"(?i)\blogin\s+\S+\s+password\s+([^\s'\"]+)", 1),
    # Command-line flags: --password X, --hf-token=X, -p is too ambiguous to touch.
    _rule(
        "cli_secret",
        r"(?i)(?<![A-Za-z0-9-])--[a-z0-9-]*(?:password|passwd|token|secret|api-key|apikey)(?:=|\s+)(?!-)(\S+)",
        1,
    ),
    _rule("aws_secret_key", r"(?i)aws.{0,20}?secret.{0,20}?[=:]\s*[\"']?([A-Za-z0-9/+=]{40})(?![A-Za-z0-9/+=])", 1),
)

EMAIL_RULE: Final = _rule(
    "email", r"(?<![A-Za-z0-9._%+-])[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}(?![A-Za-z0-9-])"
)

# JSON request logs: values of these keys are what a user typed or a model wrote.
PROMPT_KEYS: Final = frozenset({
    "prompt", "prompts", "input", "inputs", "system", "completion", "completions",
    "instructions", "query", "generated_text", "suffix",
})
# Inside these containers every "content" / "text" value is conversation text.
CONVERSATION_KEYS: Final = frozenset({"messages", "choices", "contents", "conversation", "history"})
TEXT_KEYS: Final = frozenset({"content", "text", "parts"})
_PROMPT_FALLBACK = re.compile(
    r'"(?P<key>prompt|prompts|input|inputs|system|completion|instructions|query|content|text)"'
    r'\s*:\s*"(?P<value>(?:[^"\\]|\\.)*)"'
)


@dataclass
class RedactionReport:
    """Counts by kind, overall and per file. Never any value."""

    by_kind: Counter[str] = field(default_factory=Counter)
    by_file: dict[str, dict[str, int]] = field(default_factory=dict)
    skipped_files: dict[str, str] = field(default_factory=dict)

    def add(self, name: str, counts: Counter[str]) -> None:
        self.by_kind.update(counts)
        if counts:
            self.by_file[name] = dict(sorted(counts.items()))

    def to_dict(self) -> dict[str, Any]:
        return {
            "total": sum(self.by_kind.values()),
            "by_kind": dict(sorted(self.by_kind.items())),
            "by_file": dict(sorted(self.by_file.items())),
            # A list of records, not a dict keyed by file name: a name like `mqtt-password`
            # would read as a secret key to the redactor that runs over this report too.
            "skipped_files": [{"name": name, "reason": reason}
                              for name, reason in sorted(self.skipped_files.items())],
        }


def _prompt_marker(value: str | list[Any]) -> str:
    unit = "chars" if isinstance(value, str) else "items"
    return f"{MARKER_PREFIX}prompt:{len(value)} {unit}]"


class Redactor:
    """Stateless apart from its rules; one instance can serve a whole bundle."""

    def __init__(self, extra_literals: tuple[str, ...] = ()) -> None:
        # Literal secrets known to this host (never shorter than 6 characters, so that a short
        # word does not wipe half a log) are replaced wherever they appear.
        self._literals = tuple(sorted({s for s in extra_literals if len(s) >= 6}, key=len, reverse=True))

    def redact(self, text: str) -> tuple[str, Counter[str]]:
        counts: Counter[str] = Counter()
        for _ in range(MAX_PASSES):
            new = self._one_pass(text, counts)
            if new == text:
                break
            text = new
        return text, counts

    def redact_text(self, text: str) -> str:
        return self.redact(text)[0]

    # -- one pass -----------------------------------------------------------------------------

    def _one_pass(self, text: str, counts: Counter[str]) -> str:
        text = self._redact_prompts(text, counts)
        for literal in self._literals:
            found = text.count(literal)
            if found:
                counts["known_secret"] += found
                text = text.replace(literal, marker("known_secret"))
        for rule in TOKEN_RULES:
            text = _apply(rule, text, counts)
        for rule in CONTEXT_RULES:
            text = _apply(rule, text, counts)
        text = _KEY_VALUE.sub(lambda m: _key_value(m, counts), text)
        return _apply(EMAIL_RULE, text, counts)

    # -- prompts in JSON ------------------------------------------------------------------------

    def _redact_prompts(self, text: str, counts: Counter[str]) -> str:
        stripped = text.strip()
        if stripped[:1] in "{[" and len(stripped) > 1:
            try:
                data = json.loads(stripped)
            except ValueError:
                pass
            else:
                before = counts["prompt"]
                new = _walk(data, counts, in_conversation=False)
                if counts["prompt"] == before:
                    return text
                return json.dumps(new, ensure_ascii=False, indent=2) + ("\n" if text.endswith("\n") else "")
        if '"' not in text:
            return text
        return "".join(self._redact_json_line(line, counts) for line in text.splitlines(keepends=True))

    def _redact_json_line(self, line: str, counts: Counter[str]) -> str:
        start = line.find("{")
        if start < 0:
            return line
        try:
            data, end = json.JSONDecoder().raw_decode(line, start)
        except ValueError:
            return _PROMPT_FALLBACK.sub(lambda m: _fallback_prompt(m, line, counts), line)
        before = counts["prompt"]
        new = _walk(data, counts, in_conversation=False)
        if counts["prompt"] == before:
            return line
        return line[:start] + json.dumps(new, ensure_ascii=False) + line[end:]


def _apply(rule: Rule, text: str, counts: Counter[str]) -> str:
    def replace(match: re.Match[str]) -> str:
        whole = match.group(0)
        if rule.group == 0:
            if _is_marker(whole):
                return whole
            counts[rule.kind] += 1
            return marker(rule.kind)
        value = match.group(rule.group)
        if value is None or _is_marker(value) or value.startswith(MARKER_PREFIX):
            return whole
        counts[rule.kind] += 1
        start, end = match.span(rule.group)
        offset = match.start()
        return whole[: start - offset] + marker(rule.kind) + whole[end - offset:]

    return rule.pattern.sub(replace, text)


def _key_value(match: re.Match[str], counts: Counter[str]) -> str:
    key, sep, value = match.group("key"), match.group("sep"), match.group("value")
    inner = value[1:-1] if value[:1] in "\"'" and len(value) >= 2 else value
    if (
        _NOT_SECRET_KEYS.search(key)
        or inner.strip().lower() in _HARMLESS_VALUES
        or _SHORT_NUMBER.fullmatch(inner.strip())
        or inner.startswith(MARKER_PREFIX)
    ):
        return match.group(0)
    counts["secret_value"] += 1
    quote = value[0] if value[:1] in "\"'" and len(value) >= 2 else ""
    return f"{key}{sep}{quote}{marker('secret_value')}{quote}"


def _fallback_prompt(match: re.Match[str], line: str, counts: Counter[str]) -> str:
    key, value = match.group("key"), match.group("value")
    # In a line that is not valid JSON (cut off by a log size limit, say), "content"/"text" only
    # count as conversation when the line talks about messages or choices.
    if key in ("content", "text") and not re.search(r'"(?:messages|choices|role)"', line):
        return match.group(0)
    if _is_marker(value):
        return match.group(0)
    counts["prompt"] += 1
    return f'"{key}": "{_prompt_marker(value)}"'


def _walk(node: Any, counts: Counter[str], *, in_conversation: bool) -> Any:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for key, value in node.items():
            lowered = str(key).lower()
            # A table under a prompt key is not a prompt (`[collectors.system]` in a config
            # dump, say): only strings and lists are conversation text.
            is_text = isinstance(value, (str, list))
            if is_text and (lowered in PROMPT_KEYS or (in_conversation and lowered in TEXT_KEYS)):
                out[key] = _blank(value, counts)
            else:
                out[key] = _walk(value, counts, in_conversation=in_conversation or lowered in CONVERSATION_KEYS)
        return out
    if isinstance(node, list):
        return [_walk(item, counts, in_conversation=in_conversation) for item in node]
    return node


def _blank(value: Any, counts: Counter[str]) -> Any:
    """Replace conversation content, keeping its shape and sizes."""
    if isinstance(value, str):
        if _is_marker(value):
            return value
        counts["prompt"] += 1
        return _prompt_marker(value)
    if isinstance(value, list):
        if value and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            counts["prompt"] += 1  # token ids decode back to the text
            return _prompt_marker(value)
        return [_blank(v, counts) for v in value]
    if isinstance(value, dict):
        # Content parts ({"type": "text", "text": ...}): keep the type, blank the text.
        return {k: (v if k in ("type", "role", "name") else _blank(v, counts)) for k, v in value.items()}
    return value

