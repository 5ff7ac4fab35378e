"""The application profile's command-line flags: one per `AppProfile` field, declared by the
field's metadata (flag, help, metavar; workloads/serving/profile.py), so a new field is a new
flag without a line here. The values arrive as text and are parsed and validated once, by
`profile_from_flags`, whose errors name the flag."""

from __future__ import annotations

import argparse
import dataclasses

from workloads.serving.profile import AppProfile, profile_from_flags


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per AppProfile field, its value kept as text in `serving_<field>`."""
    for f in dataclasses.fields(AppProfile):
        meta = f.metadata
        parser.add_argument(meta["flag"], dest=f"serving_{f.name}", metavar=meta["metavar"],
                            help=meta["help"], default=None)


def from_args(args: argparse.Namespace) -> AppProfile:
    """The AppProfile the flags describe (ConfigError names the flag)."""
    return profile_from_flags({f.name: getattr(args, f"serving_{f.name}")
                               for f in dataclasses.fields(AppProfile)})
