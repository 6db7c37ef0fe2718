"""griffe extension for the API reference: a method that overrides a documented one without a docstring of
its own (Checkpoint.load of BaseCheckpoint.load) shows the docstring it overrides, as help() does."""

from __future__ import annotations

from typing import Any

import griffe


class InheritDocstrings(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        self._visit(pkg)

    on_package_loaded = on_package  # the same event under griffe 1's name

    def _visit(self, obj: griffe.Object) -> None:
        for member in obj.members.values():
            if member.is_alias:
                continue
            if member.is_class:
                self._inherit(member)  # type: ignore[arg-type]
            if member.is_module or member.is_class:
                self._visit(member)  # type: ignore[arg-type]

    @staticmethod
    def _inherit(cls: griffe.Class) -> None:
        try:
            parents = cls.mro()
        except Exception:  # a base outside the package that cannot be resolved
            return
        for name, member in cls.members.items():
            if member.is_alias or member.docstring is not None:
                continue
            for parent in parents:
                found = parent.members.get(name)
                if found is not None and not found.is_alias and found.docstring is not None:
                    member.docstring = griffe.Docstring(found.docstring.value, parent=member)
                    break
