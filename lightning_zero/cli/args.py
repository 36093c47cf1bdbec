"""What every lightning-zero command shares: the one-line input error and an argparse that raises it."""

from __future__ import annotations

import argparse


class InputError(Exception):
    """Bad input, reported by ``main`` as one line and exit code 2 (the cause's traceback with --debug)."""


class Parser(argparse.ArgumentParser):
    """argparse whose usage errors are InputErrors: one line from main() (the usage is in --help)."""

    def error(self, message: str):
        raise InputError(message)
