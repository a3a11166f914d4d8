"""How a store URL (`--snapshot-dir s3://bucket/prefix`, `--export-dir`) must be spelled, checked before anything
uses it: one spelling per prefix, so that two spellings never make two prefixes, and no URL mistaken for a folder.

Refused, in one line naming the URL and how to write it: a store's scheme with one slash or none (`s3:/bucket/x`
would otherwise be a local folder `s3:`), a scheme in capitals (`S3://`), and an empty part in the path
(`s3://bucket//x`, which the store keeps apart from `s3://bucket/x`)."""

import re

SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):(.*)\Z", re.DOTALL)  # two letters at least: C:/ is a drive


def _known(scheme: str) -> bool:
    from fsspec.registry import known_implementations  # a dependency of torch

    return scheme in known_implementations


def url_spelling_problem(value: str) -> str | None:
    """What is wrong with the spelling of `value` as a store URL (a folder that only looks like one counts), in
    one phrase naming it; None for a folder or a well-spelled URL."""
    match = SCHEME.match(value)
    if match is None:
        return None
    scheme, rest = match.groups()
    if not rest.startswith("//"):
        if not _known(scheme.lower()):
            return None  # a folder with a colon in its name
        return f"{value!r} is neither a store URL ({scheme.lower()}:// takes two slashes) nor a folder to write"
    path = rest[2:]
    spelled = f"{scheme.lower()}://{path[:1]}{re.sub('/{2,}', '/', path[1:])}"
    if scheme != scheme.lower():
        return f"{value!r}: write the store's scheme in lower case ({spelled})"
    if spelled != value:
        return f"{value!r} has an empty part (//) in its path, a prefix of its own on the store: write {spelled}"
    return None
