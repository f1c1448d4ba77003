"""The `twell` command line."""

from __future__ import annotations

import argparse
import sys

import twell


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="twell", description="Activation-sparse FFNs: conversion reports.")
    parser.add_argument("--version", action="version", version=f"twell {twell.__version__}")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("report", help="conversion report for a model (the built-in demo model by default)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command is None:
        build_parser().print_help()
        return 0
    print(f"twell {twell.__version__}: the conversion report arrives with the calibration issue.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
