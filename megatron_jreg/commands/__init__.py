"""The commands: each module parses one command line and runs it; the only place the
package uses argparse."""
