"""What a process measures about itself, read by its metrics and the dashboard: garbage
collection pauses, event-loop lag, the task stream, giving freed heap back to the OS.

Leaves: import nothing else of the package.
"""
