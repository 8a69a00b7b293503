"""Read a YAML file the user names (a suite, a tuned-values file) and say in one line what is wrong
with it when it is not one: a directory, a binary or non-UTF-8 file, invalid YAML, or a mapping
that repeats a key (PyYAML keeps the last value silently; issue 29, item 2)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


class YamlFileError(ValueError):
    """The file cannot be read as YAML; the message names the file and the fix."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a mapping holding the same key twice."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in seen:
                    raise YamlFileError(f"line {line}: key {key!r} is set twice in one mapping (first on "
                                        f"line {seen[key]}); remove one of them")
                seen[key] = line
            except TypeError:  # an unhashable key: the base class reports it
                break
        return super().construct_mapping(node, deep)


def read_yaml(path: Path) -> Any:
    """The YAML document of ``path``, or :class:`YamlFileError` naming the file, what it is and the fix."""
    if path.is_dir():
        raise YamlFileError(f"{path}: is a directory, not a suite file; name a .yaml file, e.g. "
                            f"{path / 'table1.yaml'} (see `pflbench list suites`)")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise YamlFileError(f"{path}: not a text file (byte {err.start} is not UTF-8); use a YAML suite "
                            f"file saved as UTF-8") from None
    except OSError as err:
        raise YamlFileError(f"{path}: cannot be read ({err.strerror}); make it readable or name another file") from None
    if "\x00" in text:
        raise YamlFileError(f"{path}: a binary file (it holds NUL bytes); use a YAML suite file (text, UTF-8)")
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass
    except YamlFileError as err:
        raise YamlFileError(f"{path}: {err}") from None
    except yaml.YAMLError as err:
        raise YamlFileError(f"{path}: not valid YAML: {' '.join(str(err).split())}; e.g. check the "
                            f"indentation and quoting there") from None
