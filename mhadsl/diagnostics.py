"""Source locations and the one error type every stage raises.

A user mistake in a `.mha` file is an `MhaError` carrying a `Span`; the CLI and the
Python API print it as ``file:line:col: error: message`` followed by the source line
and a caret, never as a traceback.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Source:
    """A `.mha` text and the name it is reported under."""

    name: str
    text: str

    def line(self, lineno: int) -> str:
        lines = self.text.splitlines()
        return lines[lineno - 1] if 0 < lineno <= len(lines) else ""


@dataclass(frozen=True)
class Span:
    """A 1-based line/column position in a source (the start of a construct)."""

    source: Source
    line: int
    column: int
    end_line: int = 0
    end_column: int = 0

    def __repr__(self) -> str:  # keeps AST dumps short
        return f"{self.source.name}:{self.line}:{self.column}"


@dataclass(frozen=True)
class Diagnostic:
    span: Span | None
    message: str

    def render(self) -> str:
        if self.span is None:
            return f"error: {self.message}"
        text = self.span.source.line(self.span.line).expandtabs(1)
        caret = " " * max(self.span.column - 1, 0) + "^"
        return (f"{self.span.source.name}:{self.span.line}:{self.span.column}: error: "
                f"{self.message}\n{text}\n{caret}")


class MhaError(Exception):
    """One or more user errors in `.mha` input, each with its source location."""

    def __init__(self, diagnostics: list[Diagnostic] | Diagnostic | str, span: Span | None = None):
        if isinstance(diagnostics, str):
            diagnostics = [Diagnostic(span, diagnostics)]
        elif isinstance(diagnostics, Diagnostic):
            diagnostics = [diagnostics]
        self.diagnostics: list[Diagnostic] = list(diagnostics)
        super().__init__(self.render())

    def render(self) -> str:
        return "\n".join(d.render() for d in self.diagnostics)


@dataclass
class DiagnosticSink:
    """Collects errors so one run reports all of them, then raises them together."""

    diagnostics: list[Diagnostic] = field(default_factory=list)

    def error(self, span: Span | None, message: str) -> None:
        self.diagnostics.append(Diagnostic(span, message))

    def raise_if_any(self) -> None:
        if self.diagnostics:
            raise MhaError(self.diagnostics)
