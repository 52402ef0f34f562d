"""`python -m agent` runs `edge-agent` (what `coordinator emulate` starts for each agent)."""

from agent.cli import main

main(prog_name="edge-agent")
