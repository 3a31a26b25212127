"""A Grafana dashboard's Prometheus queries, run the way Grafana runs them.

Grafana resolves each query variable (`label_values(...)`) against the data source in the
dashboard's order, a variable's query seeing the ones before it, and substitutes the selection
into every panel's query: a variable that allows several values (`multi` or `includeAll`)
becomes a regular expression, each value escaped and several joined as `(a|b)`; "All" without
an `allValue` is every value the query found. Built-in `$__interval` and friends get the
values Grafana would give for a short time range. That is Grafana's documented behaviour for
the Prometheus data source (grafana.com/docs/grafana/latest/datasources/prometheus/template-
variables/); this module is a small reimplementation for tests, not Grafana's code.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tests.support.prometheus_server import PrometheusServer


@dataclass(frozen=True)
class Variable:
    name: str
    query: str
    """`label_values(label)` or `label_values(selector, label)`."""
    multi: bool = True
    include_all: bool = True


@dataclass(frozen=True)
class Panel:
    title: str
    expr: str
    legend: str = ""


@dataclass(frozen=True)
class Dashboard:
    """The facts of a published dashboard that a test needs: where it is, and its queries."""

    title: str
    source: str
    """URL of the file at `commit`."""
    commit: str
    version: str
    """What release or change the file is, in words."""
    variables: tuple[Variable, ...]
    panels: tuple[Panel, ...]


# Grafana's built-ins for a 5-minute range at a 1 s scrape interval (the test's).
BUILTINS: Mapping[str, str] = {
    "__interval": "1s",
    "__interval_ms": "1000",
    "__rate_interval": "4s",
    "__range": "5m",
    "__range_s": "300",
    "__range_ms": "300000",
}
_REFERENCE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\[\[(\w+)\]\]|\$(\w+)")
_LABEL_VALUES = re.compile(
    r"^\s*label_values\(\s*(?:(?P<selector>.+?)\s*,\s*)?(?P<label>[A-Za-z_]\w*)\s*\)\s*$"
)
_REGEX_SPECIAL = frozenset("$^*{}[]'+?.()|")


class DashboardError(AssertionError):
    """The dashboard asks for something this reimplementation (or Prometheus) cannot give."""


def regex_escape(value: str) -> str:
    """A value as Grafana writes it into a regex matcher's double-quoted string: each regex
    metacharacter gets a regex backslash, itself escaped for the string (`.` becomes two
    backslashes and the dot in the query text)."""
    text = value.replace("\\", "\\\\\\\\")
    return "".join("\\\\" + c if c in _REGEX_SPECIAL else c for c in text)


def format_selection(variable: Variable, values: Sequence[str]) -> str:
    if not values:
        raise DashboardError(f"variable ${variable.name} has no values to select")
    if not (variable.multi or variable.include_all):
        return values[0]
    escaped = [regex_escape(v) for v in values]
    return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"


def interpolate(expr: str, selections: Mapping[str, str]) -> str:
    """Every `$name`, `${name}` and `[[name]]` of a variable or built-in replaced. A `$`
    reference to anything else fails (a variable the dashboard gained since the test's list
    was written), except `$1`-style replacement groups of label_replace."""

    def replace(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2) or match.group(3)
        if name in selections:
            return selections[name]
        if name in BUILTINS:
            return BUILTINS[name]
        if name.isdigit():
            return match.group(0)
        raise DashboardError(f"unknown variable ${name} in {expr!r}")

    return _REFERENCE.sub(replace, expr)


def label_values(prom: PrometheusServer, query: str) -> list[str]:
    """A `label_values(...)` variable query through the HTTP API, as Grafana asks it."""
    match = _LABEL_VALUES.match(query)
    if match is None:
        raise DashboardError(f"not a label_values() query: {query!r}")
    params = {"match[]": match["selector"]} if match["selector"] else {}
    values: list[str] = prom.api(f"label/{match['label']}/values", **params)
    return sorted(values)


def resolve(
    prom: PrometheusServer, dashboard: Dashboard
) -> tuple[dict[str, list[str]], dict[str, str]]:
    """Each variable's values and its "All" selection, in the dashboard's order."""
    found: dict[str, list[str]] = {}
    selections: dict[str, str] = {}
    for variable in dashboard.variables:
        values = label_values(prom, interpolate(variable.query, selections))
        found[variable.name] = values
        selections[variable.name] = format_selection(variable, values)
    return found, selections


def selections_to_try(
    dashboard: Dashboard, found: Mapping[str, list[str]], everything: Mapping[str, str]
) -> Iterator[tuple[str, dict[str, str]]]:
    """ "All" for every variable, then each single value of each variable with the others on
    "All": the selections a user of the dashboard makes first."""
    yield "all", dict(everything)
    for variable in dashboard.variables:
        for value in found[variable.name]:
            chosen = dict(everything)
            chosen[variable.name] = format_selection(variable, [value])
            yield f"{variable.name}={value}", chosen


LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def query_all_panels(
    prom: PrometheusServer,
    dashboard: Dashboard,
    check: Callable[[Panel, str, list[dict[str, Any]]], str | None],
) -> list[str]:
    """Run every panel under every selection; `check` says what is wrong with a result (None:
    nothing). Returns every complaint, each naming the panel, the selection and the query."""
    found, everything = resolve(prom, dashboard)
    problems = [f"${name}: no values" for name, values in found.items() if not values]
    for selection, chosen in selections_to_try(dashboard, found, everything):
        for panel in dashboard.panels:
            query = interpolate(panel.expr, chosen)
            complaint = check(panel, query, prom.query(query))
            if complaint is not None:
                problems.append(f"{panel.title!r} [{selection}] {query}: {complaint}")
    return problems
