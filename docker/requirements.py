"""Print the requirement lines of a pyproject.toml: its dependencies and the named extras.

    python requirements.py pyproject.toml [EXTRA ...] > requirements.txt

The image build installs these before copying the source, so that a code change does not
reinstall the dependencies.
"""

import sys

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: requirements.py pyproject.toml [EXTRA ...]", file=sys.stderr)
        return 2
    with open(argv[0], "rb") as f:
        project = tomllib.load(f)["project"]
    extras = project.get("optional-dependencies", {})
    unknown = [e for e in argv[1:] if e not in extras]
    if unknown:
        print(f"requirements.py: {argv[0]} has no extra {unknown[0]!r}", file=sys.stderr)
        return 2
    for req in project.get("dependencies", []) + [r for e in argv[1:] for r in extras[e]]:
        print(req)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
