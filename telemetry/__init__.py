"""What an engine step measured, and how it leaves the process. Imports nothing else of ours."""
