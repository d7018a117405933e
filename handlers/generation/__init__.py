"""Generation for a decoder (handlers/artifact/decoder.py): a request's prompt and parameters
(request.py), the prompt and each step on the worker's stream (runner.py), the next token
(sampling.py), text in and out through the archive's tokenizer (text.py), the loop with its
stop conditions (loop.py) and the answers on each route (formats.py). handlers/generating.py
serves it for the worker."""
