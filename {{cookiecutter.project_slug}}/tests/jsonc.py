"""VSCode's settings files are JSON with comments: read them as VSCode does (strings left alone).

No template variable in here: the template's own tests read its .vscode files with this same module.
"""

import json
from pathlib import Path
from typing import Any


def load_jsonc(path: Path) -> Any:
    """Parse JSON with // and /* */ comments. Strict otherwise: a trailing comma is an error."""
    text, out, i = path.read_text(encoding="utf-8"), [], 0
    while i < len(text):
        if text[i] == '"':
            end = i + 1
            while text[end] != '"':
                end += 2 if text[end] == "\\" else 1
            out.append(text[i : end + 1])
            i = end + 1
        elif text.startswith("//", i):
            i = text.find("\n", i) if "\n" in text[i:] else len(text)
        elif text.startswith("/*", i):
            i = text.index("*/", i) + 2
        else:
            out.append(text[i])
            i += 1
    return json.loads("".join(out))
