"""Jinja filters that turn cookiecutter answers into safe literals.

Free-text answers (project name, description, author) can hold quotes, backslashes and any unicode.
They are never pasted into generated files as raw text: `py_str` renders a Python string literal and
`toml_str` a TOML basic string, both valid for every input.
"""

from cookiecutter.utils import simple_filter


@simple_filter
def py_str(value):
    """A Python string literal holding `value`, quoted as ruff format quotes it: double quotes unless the text holds
    more of them than single quotes. Non-ASCII text stays readable; unprintable characters are escaped as repr does."""
    text = str(value)
    quote = "'" if text.count('"') > text.count("'") else '"'
    body = []
    for char in text:
        if char in ("\\", quote):
            body.append("\\" + char)
        elif char.isprintable():
            body.append(char)
        else:
            body.append(repr(char)[1:-1])
    return quote + "".join(body) + quote


@simple_filter
def toml_str(value):
    """A TOML basic string holding `value`: escape quotes, backslashes and control characters."""
    out = []
    for char in str(value):
        code = ord(char)
        if char == '"':
            out.append('\\"')
        elif char == "\\":
            out.append("\\\\")
        elif code < 0x20 or code == 0x7F:
            out.append(f"\\u{code:04X}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'
