"""A profile that starts from another profile of the suite (``like``) and states only what differs.

``profiles: {code_shared_init_sharing: {like: code_shared_init, description: ..., methods: {ditto:
...}}}`` is the profile ``code_shared_init`` with this one's keys written over it by the rule that
merges a suite over its shared files (:func:`benchmarks.suite.merge_rule.merge`): mappings (``set``,
``methods`` and each method's entry) merge key by key, the lists ``overrides`` are the other
profile's entries followed by this one's, and every other value (``seeds``, ``description``) is
this one's where it states one. The other profile is the suite's as read (its shared files merged
in), so ``like`` may name a profile defined in another shared file of the suite; one that is itself
``like`` another is resolved first. The suite is read with every ``like`` written out, so a
profile's runs and config hashes are the same whichever way it is written.

A ``like`` naming no profile of the suite, a circle of ``like``s, or a value that is not a profile
name fails when the suite loads, in one line naming the file that states it.
"""
from __future__ import annotations

from typing import Any

from benchmarks.suite.merge_rule import merge
from benchmarks.suite.schema import SuiteError


def like_sources(raw: Any, file: str, where: dict[str, str]) -> None:
    """Record in ``where`` (profile -> file) the profiles of ``raw`` (one file's mapping) that state
    a ``like``; a later file replaces an earlier one's entry, as its ``like`` replaces it on merge."""
    profiles = raw.get("profiles") if isinstance(raw, dict) else None
    for name, profile in (profiles or {}).items() if isinstance(profiles, dict) else ():
        if isinstance(profile, dict) and "like" in profile:
            where[str(name)] = file


def resolve_profile_likes(suite: dict, where: dict[str, str]) -> dict:
    """``suite`` with every profile that is ``like`` another written out (``where``: the file that
    states each ``like``, for errors)."""

    profiles = suite.get("profiles")
    if not isinstance(profiles, dict) or not any(isinstance(p, dict) and "like" in p for p in profiles.values()):
        return suite
    out: dict[str, Any] = {}

    def resolve(name: str, chain: tuple[str, ...]) -> Any:
        if name not in out:
            profile = profiles[name]
            if not isinstance(profile, dict) or "like" not in profile:
                out[name] = profile
                return profile
            like, at = profile["like"], f"{where.get(name, '?')}: profiles.{name}.like"
            if not isinstance(like, str) or like not in profiles:
                raise SuiteError(f"{at}: {like!r} is not a profile of the suite ({sorted(profiles)}); name one of "
                                 f"them (this profile starts from it) or write this profile in full")
            if like in (*chain, name):
                raise SuiteError(f"{at}: {' -> '.join((*chain, name, like))} goes round in a circle; write one of "
                                 f"them in full")
            own = {k: v for k, v in profile.items() if k != "like"}
            out[name] = merge(resolve(like, (*chain, name)) or {}, own)
        return out[name]

    return {**suite, "profiles": {name: resolve(str(name), ()) for name in profiles}}
