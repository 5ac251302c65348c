"""Multi-rank execution: TP/PP ranks as processes, and the rank consensus checker."""
