"""Source locations and the one error type every stage raises.

A user mistake in a `.mha` file is an `MhaError` carrying a `Span`; the CLI and the
Python API print it as ``file:line:col: error: message`` followed by the source line
and a caret, never as a traceback.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

# More errors than this are counted, not listed: past it they are noise, and a huge
# generated file would otherwise print (and build) thousands of messages.
MAX_ERRORS = 50


@dataclass(frozen=True)
class Source:
    """A `.mha` text and the name it is reported under. A diagnostic in a source that is not
    `quoted` shows only its position, not the line."""

    name: str
    text: str
    quoted: bool = True

    @functools.cached_property
    def _line_starts(self) -> list[int]:
        # Found once, so reporting many errors in a big file stays linear. Lines end at
        # "\n" only, as the parser counts them.
        starts, at = [0], self.text.find("\n")
        while at >= 0:
            starts.append(at + 1)
            at = self.text.find("\n", at + 1)
        return starts

    def line(self, lineno: int) -> str:
        starts = self._line_starts
        if not 0 < lineno <= len(starts):
            return ""
        end = starts[lineno] - 1 if lineno < len(starts) else len(self.text)
        return self.text[starts[lineno - 1]:end].rstrip("\r")


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


# A source line longer than this is shown as a window around the error's column.
MAX_SHOWN_LINE = 160


@dataclass(frozen=True)
class Diagnostic:
    span: Span | None
    message: str

    def render(self) -> str:
        if self.span is None:
            return f"error: {self.message}"
        where = f"{self.span.source.name}:{self.span.line}:{self.span.column}: error: "
        if not self.span.source.quoted:
            return where + self.message
        # One character per column, so the caret lines up: tabs become one space and
        # characters a terminal would not show (NUL, escapes) become '?'.
        text = "".join(c if c.isprintable() else " " if c == "\t" else "?"
                       for c in self.span.source.line(self.span.line)[:self.span.column
                                                                      + MAX_SHOWN_LINE])
        column = max(self.span.column - 1, 0)
        if len(text) > MAX_SHOWN_LINE:
            start = max(0, column - MAX_SHOWN_LINE // 2)
            shown = text[start:start + MAX_SHOWN_LINE]
            text = ("..." if start else "") + shown + ("..." if start + len(shown) < len(text)
                                                      else "")
            column += (3 if start else 0) - start
        return f"{where}{self.message}\n{text}\n{' ' * column}^"


class MhaError(Exception):
    """One or more user errors in `.mha` input, each with its source location.

    `omitted` counts errors found past `MAX_ERRORS`; they are not kept, only counted.
    """

    def __init__(self, diagnostics: list[Diagnostic] | Diagnostic | str, span: Span | None = None,
                 omitted: int = 0):
        if isinstance(diagnostics, str):
            diagnostics = [Diagnostic(span, diagnostics)]
        elif isinstance(diagnostics, Diagnostic):
            diagnostics = [diagnostics]
        self.diagnostics: list[Diagnostic] = list(diagnostics)
        self.omitted = omitted
        super().__init__()

    def __str__(self) -> str:
        return self.render()

    def render(self) -> str:
        shown = self.diagnostics[:MAX_ERRORS]
        more = len(self.diagnostics) - len(shown) + self.omitted
        lines = [d.render() for d in shown]
        if more:
            lines.append(f"... and {more} more error{'s' if more > 1 else ''}")
        return "\n".join(lines)


@dataclass
class DiagnosticSink:
    """Collects errors so one run reports all of them (up to `MAX_ERRORS`), then raises
    them together."""

    diagnostics: list[Diagnostic] = field(default_factory=list)
    omitted: int = 0

    def error(self, span: Span | None, message: str) -> None:
        if len(self.diagnostics) < MAX_ERRORS:
            self.diagnostics.append(Diagnostic(span, message))
        else:
            self.omitted += 1

    def raise_if_any(self) -> None:
        if self.diagnostics:
            raise MhaError(self.diagnostics, omitted=self.omitted)
