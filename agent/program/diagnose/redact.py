"""Redaction: secrets, personal data and prompt text out of anything that goes into a bundle.

A diagnostic bundle leaves the machine (a support ticket, a chat), so every byte of it goes
through `Redactor.redact` first. What is removed: cloud and hub credentials by their published
prefixes (AWS AKIA/ASIA, GitHub ghp_/github_pat_, GitLab glpat-, Hugging Face hf_, OpenAI sk-,
Anthropic sk-ant-, Slack xox*, Stripe sk_live_, npm_, pypi-, dckr_pat_, Google AIza),
contextual secrets (key=value and "key": "value" forms whose key names a secret, Authorization
headers, passwords in URLs, Azure connection strings and SAS signatures, netrc and CLI flags),
PEM private keys, password hashes (crypt, bcrypt, yescrypt, argon2), JWTs, e-mail addresses,
and the text of prompts and completions in JSON request logs (structure and lengths stay,
content goes).

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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from agent.contracts.json_text import JsonTooDeep, decode_json_at, parse_json

MARKER_PREFIX: Final = "[REDACTED:"
_MARKER = re.compile(r"\[REDACTED:[a-z0-9_]+(?::\d+ (?:chars|items))?\]")
MAX_PASSES: Final = 4


def marker(kind: str) -> str:
    return f"{MARKER_PREFIX}{kind}]"


def _is_marker(text: str) -> bool:
    return _MARKER.fullmatch(text) is not None


@dataclass(frozen=True)
class Rule:
    """One pattern. `group` is the part replaced (0: the whole match).

    `hints`: lower-case literals, one of which every match contains. A rule runs only on the
    lines holding a hint (found with C-speed string search on the lower-cased text): the regex
    engine is slow, and most lines of a log hold no secret. `whole`: the pattern spans lines
    (a PEM block), so it runs on the whole text when a hint is there.
    """

    kind: str
    pattern: re.Pattern[str]
    group: int = 0
    hints: tuple[str, ...] = ()
    whole: bool = False


def _rule(
    kind: str,
    pattern: str,
    group: int = 0,
    flags: int = 0,
    *,
    hints: tuple[str, ...],
    whole: bool = False,
) -> Rule:
    return Rule(kind, re.compile(pattern, flags), group, hints, whole)


# Key names whose value is a secret. A key must END with one of these words, so that
# `max_tokens`, `tokenizer` or `author` stay, and tokenizer settings (`pad_token`) are not
# mistaken for credentials. A numbered key (`password2`) and a few suffixes that still name the
# secret itself (`SECRET_KEY_BASE`, `client-key-data`) count too.
_SECRET_KEY_WORDS = "|".join(
    (  # key names, not passwords
        r"passwd",
        r"password",
        r"passphrase",
        r"secrets?",
        r"token",
        r"api[_-]?key",
        r"apikey",
        r"access[_-]?key(?:[_-]?id)?",
        r"secret[_-]?key",
        r"private[_-]?key(?:[_-]?id)?",
        r"auth",
        r"authorization",
        r"credentials?",
        r"cookie",
        r"session[_-]?id",
        r"signature",
        r"client[_-]?secret",
        r"client[_-]?key[_-]?data",
        r"client[_-]?certificate[_-]?data",
    )
)
_SECRET_KEY_SUFFIX = r"\d*(?:[_-](?:base|value|data|b64|base64))?"  # noqa: S105 (a pattern, not a password)
# `pass` and `pwd` are also the ends of ordinary words (`bypass`, `compass`): they name a secret
# only as the whole key or as its last `_`/`.`/`-` separated part (`DB_PASS`, `mqtt.pwd`).
_SHORT_SECRET_KEY = r"(?:[A-Za-z0-9_.-]*[_.-])?(?:pass|pwd)"  # noqa: S105 (a pattern, not a password)
_NOT_SECRET_KEYS = re.compile(
    r"(?i)(?:^|[_.-])(?:pad|eos|bos|unk|sep|cls|mask|special|start|end|max|num|n)[_-]?tokens?$"
)
# An unquoted value runs over several words (`password: my secret phrase`), up to the end of
# the line, a closing bracket or quote of the structure around it, a comment, a shell operator,
# a command-line flag or the next `key=` / `key:` pair (`use_auth_token=True push_to_hub=false`).
# A comma or semicolon ends a word when a space or the line's end follows (`"a": 2, "b": 3`).
_WORD = (
    r"""(?:\[REDACTED:[^\]\s]*\]|[^\s"'\[{(\]}),;]|[,;](?![\s"'\]})]|$))"""
    r"""(?:\[REDACTED:[^\]\s]*\]|[^\s"\[{(\]}),;]|[,;](?![\s"'\]})]|$))*"""
)
_NEXT_WORD = rf"""[ \t]+(?![#|&;<>-]|[A-Za-z0-9_.-]+["']?[ \t]*(?:=|:(?!//)))(?={_WORD})"""
_VALUE = (
    r"""(?:\[REDACTED:[^\]\s]*\]"""
    r"""|"(?:[^"\\\n]|\\.)*"|'[^'\n]*'"""
    r"""|\([^()\n]*\)"""  # password=(x)
    rf"""|{_WORD}(?:{_NEXT_WORD}{_WORD})*"""
    r"""|"(?:[^"\\\n]|\\.)*|'[^'\n]*)"""  # an unterminated quote: to the end of the line
)
_KEY_VALUE = re.compile(
    rf"""(?ix)
    (?P<key>(?<![A-Za-z0-9_])(?:[A-Za-z0-9_.-]*?(?:{_SECRET_KEY_WORDS})|{_SHORT_SECRET_KEY}){_SECRET_KEY_SUFFIX})
    (?![A-Za-z0-9])
    (?P<sep>["']?[ \t]*(?::=|=>|=|:(?!//))[ \t]*(?:(?:bearer|basic|token|digest)[ \t]+)?)
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
        hints=("private key",),
        whole=True,
    ),
    # The tail of a key whose BEGIN line was cut off (a file included from its last N bytes):
    # the base64 lines that run up to an END line are the key.
    _rule(
        "private_key",
        r"(?m)^(?:[A-Za-z0-9+/=]+\r?\n)+-----END [A-Z0-9 ]*PRIVATE KEY( BLOCK)?-----",
        hints=("private key",),
        whole=True,
    ),
    # Password hashes (crypt(3) in /etc/shadow, htpasswd, a users file, web-config.yml): offline
    # they are as good as the password to a cracker. md5crypt, sha256crypt, sha512crypt (with
    # rounds=), Apache's apr1, bcrypt, yescrypt, gost-yescrypt, scrypt and argon2 (PHC format).
    # The digest lengths are the formats' own, so `$1$HOME` or `awk '{print $1$2}'` stay.
    _rule(
        "password_hash",
        r"(?<![A-Za-z0-9$./])\$(?:"
        r"[156]\$(?:rounds=\d+\$)?[^\s$:'\"]{0,16}\$[./A-Za-z0-9]{22,86}"
        r"|apr1\$[^\s$:'\"]{0,8}\$[./A-Za-z0-9]{22}"
        r"|2[abxy]?\$\d\d\$[./A-Za-z0-9]{53}"
        r"|(?:y|gy|7)\$[./A-Za-z0-9]+\$(?:[./A-Za-z0-9]*\$)?[./A-Za-z0-9]{43}"
        r"|argon2(?:id|i|d)\$(?:v=\d+\$)?m=\d+,t=\d+,p=\d+(?:,[a-z]+=[A-Za-z0-9+/]*)*"
        r"\$[A-Za-z0-9+/]+\$[A-Za-z0-9+/]{16,}"
        r")(?![./A-Za-z0-9+])",
        hints=("$1$", "$5$", "$6$", "$apr1$", "$2", "$y$", "$gy$", "$7$", "$argon2"),
    ),
    _rule(
        "aws_access_key_id",
        r"(?<![A-Za-z0-9])(?:AKIA|ASIA|AGPA|AIDA|AROA|ANPA|AIPA)[A-Z0-9]{16}(?![A-Za-z0-9])",
        hints=("akia", "asia", "agpa", "aida", "aroa", "anpa", "aipa"),
    ),
    _rule(
        "github_token",
        r"(?<![A-Za-z0-9_])(?:ghp|gho|ghu|ghs|ghr)_[A-Za-z0-9]{30,255}",
        hints=("ghp_", "gho_", "ghu_", "ghs_", "ghr_"),
    ),
    _rule(
        "github_token", r"(?<![A-Za-z0-9_])github_pat_[A-Za-z0-9_]{22,255}", hints=("github_pat_",)
    ),
    _rule(
        "gitlab_token",
        r"(?<![A-Za-z0-9_])gl(?:pat|dt|rt|cbt|ptt)-[A-Za-z0-9_-]{20,}",
        hints=("glpat-", "gldt-", "glrt-", "glcbt-", "glptt-"),
    ),
    _rule(
        "huggingface_token",
        r"(?<![A-Za-z0-9_])(?:hf|api_org)_[A-Za-z0-9]{30,}",
        hints=("hf_", "api_org_"),
    ),
    _rule("anthropic_key", r"(?<![A-Za-z0-9_-])sk-ant-[A-Za-z0-9_-]{20,}", hints=("sk-ant-",)),
    _rule(
        "openai_key",
        r"(?<![A-Za-z0-9_-])sk-(?:proj-|svcacct-|admin-)?[A-Za-z0-9_-]{20,}",
        hints=("sk-",),
    ),
    _rule("slack_token", r"(?<![A-Za-z0-9_])xox[abposre]-[A-Za-z0-9-]{10,}", hints=("xox",)),
    _rule(
        "slack_webhook",
        r"https://hooks\.slack\.com/(?:services|workflows)/[A-Za-z0-9/_-]+",
        hints=("hooks.slack.com",),
    ),
    _rule(
        "stripe_key",
        r"(?<![A-Za-z0-9_])(?:sk|rk|pk)_(?:live|test)_[A-Za-z0-9]{16,}",
        hints=("_live_", "_test_"),
    ),
    _rule("npm_token", r"(?<![A-Za-z0-9_])npm_[A-Za-z0-9]{36}", hints=("npm_",)),
    _rule("pypi_token", r"(?<![A-Za-z0-9_])pypi-[A-Za-z0-9_-]{40,}", hints=("pypi-",)),
    _rule("docker_token", r"(?<![A-Za-z0-9_])dckr_pat_[A-Za-z0-9_-]{20,}", hints=("dckr_pat_",)),
    _rule("google_api_key", r"(?<![A-Za-z0-9_])AIza[0-9A-Za-z_-]{35}", hints=("aiza",)),
    _rule("google_oauth_token", r"(?<![A-Za-z0-9_])ya29\.[0-9A-Za-z_-]{20,}", hints=("ya29.",)),
    _rule(
        "jwt",
        r"(?<![A-Za-z0-9_-])eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}",
        hints=("eyj",),
    ),
)

CONTEXT_RULES: Final[tuple[Rule, ...]] = (
    # Azure storage / service bus connection strings and SAS tokens.
    _rule(
        "azure_key",
        r"(?i)(?:AccountKey|SharedAccessKey|SharedAccessSignature)=([^;\s\"'<>]+)",
        1,
        hints=("accountkey=", "sharedaccesskey=", "sharedaccesssignature="),
    ),
    _rule("azure_sas", r"(?i)[?&]sig=([^&\s\"'<>]+)", 1, hints=("sig=",)),
    # scheme://user:password@host — the user name stays (it says which account), the password goes.
    # The password runs to the LAST `@` of the authority (`user:p@ss@host`): the host never
    # holds an `@`, a password may.
    _rule(
        "url_password", r"(?i)\b[a-z][a-z0-9+.-]*://[^/\s:@\"']*:([^/?#\s\"']+)@", 1, hints=("://",)
    ),
    _rule("bearer_token", r"(?i)\bbearer[ \t]+([A-Za-z0-9._~+/=-]{8,})", 1, hints=("bearer",)),
    # W&B keys are 40 hex digits; `wandb login KEY` ends up in shell histories.
    _rule(
        "wandb_key",
        r"(?i)\bwandb[ \t]+login[ \t]+(?:--\S+[ \t]+)*([0-9a-f]{40})\b",
        1,
        hints=("wandb",),
    ),
    # netrc: machine HOST login USER password SECRET (one line, or one key per line).
    _rule(
        "netrc_password",
        r"(?im)(?:^|[ \t])password[ \t]+(?!is\b|for\b|was\b|to\b)([^\s'\"]+)[ \t]*$",
        1,
        hints=("password",),
    ),
    _rule(
        "netrc_password",
        r"(?i)\blogin[ \t]+\S+[ \t]+password[ \t]+([^\s'\"]+)",
        1,
        hints=("password",),
    ),
    # Command-line flags: --password X, --hf-token=X, -p is too ambiguous to touch.
    _rule(
        "cli_secret",
        r"(?i)(?<![A-Za-z0-9-])--[a-z0-9-]*(?:password|passwd|token|secret|api-key|apikey)(?:=|[ \t]+)(?!-)(\S+)",
        1,
        hints=("--",),
    ),
    # curl -u USER:PASSWORD (and --user); `-u 1000:1000` (docker's uid:gid) is not a password.
    _rule(
        "cli_secret",
        r"(?<!\S)(?:-u|--user)(?:=|[ \t]+)[\"']?[^\s:\"']*:(?!\d+(?:[\s\"']|$))([^\s\"']+)",
        1,
        hints=("-u",),
    ),
    # mysql -pPASSWORD: the password glued to -p (a separate word after -p is a prompt's answer,
    # never on the line). Only for the MySQL clients: elsewhere -p is a port or a path.
    _rule(
        "cli_secret",
        r"(?i:\b(?:mysql|mariadb)[a-z-]*\b)[^\n|;&]*?(?<!\S)-p([^\s-]\S*)",
        1,
        hints=("mysql", "mariadb"),
    ),
    # <password>x</password> in XML configs (Maven settings, Hadoop site files).
    _rule(
        "secret_value",
        rf"(?i)<((?:[A-Za-z0-9_.:-]*?(?:{_SECRET_KEY_WORDS})|{_SHORT_SECRET_KEY}){_SECRET_KEY_SUFFIX})>"
        r"(?!\[REDACTED:)([^<\n]+)</\1>",
        2,
        hints=("</",),
    ),
    _rule(
        "aws_secret_key",
        r"(?i)aws.{0,20}?secret.{0,20}?[=:][ \t]*[\"']?([A-Za-z0-9/+=]{40})(?![A-Za-z0-9/+=])",
        1,
        hints=("aws",),
    ),
)

EMAIL_RULE: Final = _rule(
    "email",
    r"(?<![A-Za-z0-9._%+-])[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}(?![A-Za-z0-9-])",
    hints=("@",),
)

# JSON request logs: values of these keys are what a user typed or a model wrote.
PROMPT_KEYS: Final = frozenset(
    {
        "prompt",
        "prompts",
        "input",
        "inputs",
        "system",
        "completion",
        "completions",
        "instructions",
        "query",
        "generated_text",
        "suffix",
    }
)
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
            "skipped_files": [
                {"name": name, "reason": reason}
                for name, reason in sorted(self.skipped_files.items())
            ],
        }


def _prompt_marker(value: str | list[Any]) -> str:
    unit = "chars" if isinstance(value, str) else "items"
    return f"{MARKER_PREFIX}prompt:{len(value)} {unit}]"


class Redactor:
    """Stateless apart from its rules; one instance can serve a whole bundle."""

    def __init__(self, extra_literals: tuple[str, ...] = ()) -> None:
        # Literal secrets known to this host (never shorter than 6 characters, so that a short
        # word does not wipe half a log) are replaced wherever they appear.
        self._literals = tuple(
            sorted({s for s in extra_literals if len(s) >= 6}, key=len, reverse=True)
        )

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
        text = _on_lines(
            text,
            _key_value_lines(text),
            lambda part: _KEY_VALUE.sub(lambda m: _key_value(m, counts), part),
        )
        return _apply(EMAIL_RULE, text, counts)

    # -- prompts in JSON ------------------------------------------------------------------------

    def _redact_prompts(self, text: str, counts: Counter[str]) -> str:
        stripped = text.strip()
        if stripped[:1] in "{[" and len(stripped) > 1:
            try:
                data = parse_json(stripped)
                before = counts["prompt"]
                new = _walk(data, counts, in_conversation=False)
            except (JsonTooDeep, RecursionError):
                # What cannot be read into cannot be shown to hold no prompt.
                return _too_deep(text, counts) + ("\n" if text.endswith("\n") else "")
            except ValueError:
                pass
            else:
                if counts["prompt"] == before:
                    return text
                return json.dumps(new, ensure_ascii=False, indent=2) + (
                    "\n" if text.endswith("\n") else ""
                )
        if '"' not in text:
            return text
        return "".join(
            self._redact_json_line(line, counts) for line in text.splitlines(keepends=True)
        )

    def _redact_json_line(self, line: str, counts: Counter[str]) -> str:
        start = line.find("{")
        if start < 0:
            return line
        try:
            data, end = decode_json_at(line, start)
            before = counts["prompt"]
            new = _walk(data, counts, in_conversation=False)
        except (JsonTooDeep, RecursionError):
            ending = "\n" if line.endswith("\n") else ""
            return line[:start] + _too_deep(line[start:].rstrip("\n"), counts) + ending
        except ValueError:
            return _PROMPT_FALLBACK.sub(lambda m: _fallback_prompt(m, line, counts), line)
        if counts["prompt"] == before:
            return line
        return line[:start] + json.dumps(new, ensure_ascii=False) + line[end:]


def _line_spans(text: str, positions: list[int]) -> list[tuple[int, int]]:
    """The lines holding these positions, as merged (start, end) spans."""
    spans: list[tuple[int, int]] = []
    for position in sorted(positions):
        if spans and position < spans[-1][1]:
            continue
        start = text.rfind("\n", 0, position) + 1
        end = text.find("\n", position)
        end = len(text) if end < 0 else end + 1
        if spans and start <= spans[-1][1]:
            spans[-1] = (spans[-1][0], end)
        else:
            spans.append((start, end))
    return spans


def _hint_spans(text: str, rule: Rule) -> list[tuple[int, int]]:
    lower = text.lower()
    if len(lower) != len(text):  # a character whose lower case is longer: positions shift
        return [(0, len(text))]
    positions: list[int] = []
    for hint in rule.hints:
        at = lower.find(hint)
        if at >= 0 and rule.whole:
            return [(0, len(text))]
        while at >= 0:
            positions.append(at)
            at = lower.find(hint, at + 1)
    return _line_spans(text, positions)


_KEY_VALUE_CANDIDATE = re.compile(
    rf"""(?:{_SECRET_KEY_WORDS.lower()}|pass|pwd){_SECRET_KEY_SUFFIX}(?![a-z0-9])["']?[ \t]*(?:=|:(?!//))"""
)


def _key_value_lines(text: str) -> list[tuple[int, int]]:
    """Lines where a secret-sounding key is followed by = or :, found on the lower-cased text
    (a case-insensitive regex over the whole text is ten times slower)."""
    lower = text.lower()
    if len(lower) != len(text):
        return [(0, len(text))]
    return _line_spans(text, [m.start() for m in _KEY_VALUE_CANDIDATE.finditer(lower)])


def _on_lines(text: str, spans: list[tuple[int, int]], transform: Callable[[str], str]) -> str:
    if not spans:
        return text
    pieces: list[str] = []
    last = 0
    for start, end in spans:
        pieces.append(text[last:start])
        pieces.append(transform(text[start:end]))
        last = end
    pieces.append(text[last:])
    return "".join(pieces)


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
        return whole[: start - offset] + marker(rule.kind) + whole[end - offset :]

    return _on_lines(text, _hint_spans(text, rule), lambda part: rule.pattern.sub(replace, part))


def _key_value(match: re.Match[str], counts: Counter[str]) -> str:
    key, sep, value = match.group("key"), match.group("sep"), match.group("value")
    quote = value[0] if value[:1] in "\"'" else ""
    closed = bool(quote) and len(value) >= 2 and value.endswith(quote)
    inner = value[1:-1] if closed else value[1:] if quote else value
    if (
        _NOT_SECRET_KEYS.search(key)
        or inner.strip().lower() in _HARMLESS_VALUES
        or _SHORT_NUMBER.fullmatch(inner.strip())
        or inner.startswith(MARKER_PREFIX)
        # The shell's `PWD=/home/...` is the working directory, a path support needs.
        or (key.lower().endswith("pwd") and inner.startswith(("/", "~")))
    ):
        return match.group(0)
    counts["secret_value"] += 1
    return f"{key}{sep}{quote}{marker('secret_value')}{quote if closed else ''}"


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


def _too_deep(text: str, counts: Counter[str]) -> str:
    """JSON nested deeper than the parser (or the walk after it) can follow: it goes whole."""
    counts["deep_json"] += 1
    return f"{MARKER_PREFIX}deep_json:{len(text)} chars]"


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
                out[key] = _walk(
                    value, counts, in_conversation=in_conversation or lowered in CONVERSATION_KEYS
                )
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
        return {
            k: (v if k in ("type", "role", "name") else _blank(v, counts)) for k, v in value.items()
        }
    return value
