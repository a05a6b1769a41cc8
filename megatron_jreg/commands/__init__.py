"""Entry points: one module per command; the library below never imports argparse."""
