"""A self-contained HTML page: inline CSS, images embedded as data URIs, every string escaped."""

from __future__ import annotations

import base64
import html
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd

STYLE = """
body { font-family: -apple-system, 'Segoe UI', Roboto, Helvetica, Arial, sans-serif; margin: 0 auto;
       max-width: 1100px; padding: 1.5rem; color: #1d232a; line-height: 1.45; }
h1 { font-size: 1.6rem; margin-bottom: .2rem; } h2 { font-size: 1.2rem; margin-top: 2rem;
     border-bottom: 1px solid #d7dde3; padding-bottom: .2rem; }
.subtitle { color: #56606b; margin-top: 0; }
.verdict { font-size: 1.1rem; padding: .7rem 1rem; border-radius: 6px; background: #eef5ee; border-left: 5px solid #3c8d40; }
.verdict.bad { background: #fbeeee; border-left-color: #c0392b; }
table { border-collapse: collapse; margin: .6rem 0; font-size: .9rem; }
th, td { border-bottom: 1px solid #e3e7eb; padding: .25rem .6rem; text-align: right; }
th { background: #f4f6f8; } td:first-child, th:first-child { text-align: left; }
figure { margin: 1rem 0; } figure img { max-width: 100%; height: auto; border: 1px solid #e3e7eb; }
figcaption { color: #56606b; font-size: .9rem; }
ul.words li { margin: .2rem 0; }
.grid { display: grid; grid-template-columns: repeat(auto-fit, minmax(480px, 1fr)); gap: 1rem; }
"""


def escape(value: object) -> str:
    return html.escape(str(value), quote=True)


def image(path: Path, caption: str) -> str:
    encoded = base64.b64encode(Path(path).read_bytes()).decode("ascii")
    return (
        f'<figure><img src="data:image/png;base64,{encoded}" alt="{escape(caption)}">'
        f"<figcaption>{escape(caption)} ({escape(Path(path).name)})</figcaption></figure>"
    )


def figure_grid(figures: list[tuple[Path, str]]) -> str:
    """(PNG path, caption) pairs side by side where the screen allows."""
    return '<div class="grid">' + "".join(image(path, caption) for path, caption in figures) + "</div>"


def table(frame: pd.DataFrame) -> str:
    """A pandas DataFrame as an HTML table; pandas escapes the cells. A missing value is a dash,
    also a None in a column of objects (pandas would print Python's `None` there)."""
    frame = frame.apply(
        lambda column: column.map(lambda value: "–" if value is None else value) if column.dtype == object else column
    )
    return frame.to_html(index=False, escape=True, border=0, na_rep="–")


def readable(value: object) -> str:
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e6 else f"{value:,.0f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return "–" if value is None else str(value)


def key_values(pairs: Sequence[tuple[str, object]]) -> str:
    rows = "".join(f"<tr><th>{escape(key)}</th><td>{escape(readable(value))}</td></tr>" for key, value in pairs)
    return f"<table>{rows}</table>"


def bullet_list(lines: list[str]) -> str:
    return '<ul class="words">' + "".join(f"<li>{escape(line)}</li>" for line in lines) + "</ul>"


def write_page(path: Path, title: str, subtitle: str, sections: list[str]) -> Path:
    path.write_text(
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{escape(title)}</title><style>{STYLE}</style></head><body>"
        f'<h1>{escape(title)}</h1><p class="subtitle">{escape(subtitle)}</p>'
        + "\n".join(sections)
        + "</body></html>\n",
        encoding="utf-8",
    )
    return path


def section(heading: str, *parts: str) -> str:
    return f"<section><h2>{escape(heading)}</h2>{''.join(parts)}</section>"


def verdict(text: str | list[str], good: bool) -> str:
    """A coloured banner: one sentence, or lines."""
    lines = [text] if isinstance(text, str) else text
    return f'<p class="verdict{"" if good else " bad"}">{"<br>".join(escape(line) for line in lines)}</p>'
