"""Argument types shared by the benchmark subcommands."""
import argparse


def int_at_least(low):
    """An argparse type: an integer >= low."""
    def parse(text):
        try:
            v = int(text)
        except ValueError:
            v = low - 1
        if v < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}: {text!r}")
        return v
    return parse


positive_int = int_at_least(1)
nonnegative_int = int_at_least(0)


def bit_widths(low=1):
    """An argparse type: comma-separated bit widths in low..8."""
    def parse(text):
        try:
            bits = [int(b) for b in text.split(",") if b.strip()]
        except ValueError:
            bits = []
        if not bits or any(not low <= b <= 8 for b in bits):
            raise argparse.ArgumentTypeError(f"bits must be integers in {low}..8, comma-separated: {text!r}")
        return bits
    return parse
