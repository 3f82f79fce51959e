"""Text from a submission made safe to write: `clean` (printable UTF-8 of bounded length, whatever the
value) and `csv_field` (a spreadsheet cell that is never a formula). The gradebook, feedback pages, the
review list and the workspace's files all write submission-controlled text through these two."""
from __future__ import annotations

from typing import Any

#: Characters any one text field keeps (a reason, a message): a row stays a row, a page a page.
FIELD_CHARS = 2000


def clean(value: Any, limit: int = FIELD_CHARS) -> str:
    """`value` as printable UTF-8 text of at most `limit` characters: str() of anything (a list, bytes, an
    object whose __str__ raises), lone surrogates and NUL replaced."""
    try:
        text = value if type(value) is str else str(value)
    except Exception:  # noqa: BLE001 - an object whose __str__ raises
        text = f"<unprintable {type(value).__name__}>"
    text = text[:limit + 1].encode("utf-8", "replace").decode("utf-8").replace("\x00", "\ufffd")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def csv_field(value: Any) -> str:
    """A CSV field a spreadsheet will not execute (student-controlled text may start with '=')."""
    text = clean(value).replace("\r", " ").replace("\n", " ")
    return "'" + text if text[:1] in ("=", "+", "-", "@", "\t") else text
