"""The vocabulary every role shares: how functions, specs, results and errors become
bytes (`serialize`), what travels beside a message (`wire.Blob`), and the limits a client
checks before it sends and the scheduler enforces (stories, coordination).

Imports only distributed_core: no sockets, no event loop.
"""
