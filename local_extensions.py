"""Jinja filters that turn cookiecutter answers into safe literals.

Free-text answers (project name, description, author) can hold quotes, backslashes and any unicode.
They are never pasted into generated files as raw text: `py_str` renders a Python string literal and
`toml_str` a TOML basic string, both valid for every input. `py_slug` derives the default package name
from the project name, and `k8s_name` a Kubernetes object name from the package name.
"""

import keyword
import re
import unicodedata

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


@simple_filter
def py_slug(value):
    """A lower-case Python identifier derived from a project name: `Zoë's "Net"` gives `zoës_net`.

    Whitespace and `-` become `_`; any other character that cannot be part of an identifier is dropped, while
    letters and digits Python accepts in identifiers (unicode too) are kept. Runs of `_` collapse to one and
    leading or trailing ones go. A name that would start with a digit or be a keyword gets `project_` in front;
    one with nothing usable left is `project`. The text is NFKC-normalised, as Python normalises identifiers,
    so the folder's name is the name `import` looks for.
    """
    text = unicodedata.normalize("NFKC", str(value)).lower()
    text = unicodedata.normalize("NFKC", text)  # lower() can undo the normal form (e.g. "İ" -> "i" + a dot above)
    kept = []
    for char in text:
        if char.isspace() or char == "-":
            kept.append("_")
        elif ("a" + char).isidentifier():  # a character allowed after the first one of an identifier
            kept.append(char)
    # Dropping a character can leave combining marks out of canonical order: normalise once more.
    slug = re.sub(r"_+", "_", unicodedata.normalize("NFKC", "".join(kept))).strip("_")
    if not slug:
        return "project"
    if not slug.isidentifier() or keyword.iskeyword(slug) or keyword.issoftkeyword(slug):
        slug = "project_" + slug
    return slug


@simple_filter
def k8s_name(value):
    """A Kubernetes object name derived from a slug: `zoës_net` gives `zoes-net`.

    A PyTorchJob's name must be a DNS-1035 label (lower-case ASCII letters, digits and `-`, starting with a letter),
    and its pods and services are named `<name>-worker-<index>`, which must stay within 63 characters: accents are
    dropped, every other run of characters becomes `-`, and the name is cut to 40 characters.
    """
    text = unicodedata.normalize("NFKD", str(value)).encode("ascii", "ignore").decode().lower()
    name = re.sub(r"[^a-z0-9]+", "-", text).strip("-")
    if not name[:1].isalpha():
        name = ("job-" + name).strip("-")
    return name[:40].rstrip("-")
