"""Long texts tokenized in child processes, so the gateway's own process never holds its
interpreter lock for them.

``tokenizers`` releases the lock while it encodes, but the ids it hands back become a Python
list of one int a token, built with the lock held (about 2 ms for 124K tokens), and packing them
takes another; the encoding itself takes the cores the event loop needs. A child process
(``child``) loads the engine's tokenizer once from the directory the gateway already resolved,
runs at a lower CPU priority, and answers each text with its ids packed as the gateway keeps them
(four bytes a token): the gateway reads bytes off a pipe and never makes the list.
``pool.TokenizerPool`` is the gateway's side: a few children, used by the threads that prepare
requests, never by the event loop. The children also read a long prompt's KV event batches
into columns (``kvcolumns``), which the gateway re-hashes without walking their messages.

This package imports nothing of the gateway's (the child starts in a fraction of a second).
"""
