"""What crosses process boundaries: the typed messages (``messages``), the type checks that
guard them (``json_types``) and the launcher that starts the processes and wires their sockets
(``launcher``)."""
