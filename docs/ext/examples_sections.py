"""A griffe extension for the API reference: Hydro's docstrings head their doctests
``Example:``, which Google-style parsing reads as a plain admonition (its ``>>>`` lines then
render as Markdown text). Renamed ``Examples:``, they render as code."""

from __future__ import annotations

import re

import griffe

_HEADER = re.compile(r"^(\s*)Example:\s*$", re.M)


class ExampleSections(griffe.Extension):
    """Rename each ``Example:`` section of a docstring to ``Examples:``."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: object) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _HEADER.sub(r"\1Examples:", obj.docstring.value)
