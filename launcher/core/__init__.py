"""What every layer of the launcher uses: its typed errors (errors) and the terminal
(console)."""
