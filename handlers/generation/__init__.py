"""Generation for a decoder (handlers/artifact/decoder.py): a request's prompt and parameters
(request.py), the prompt and each step on the worker's stream (runner.py), the next token
(sampling.py) and its log probabilities (logprobs.py), text in and out through the archive's tokenizer (text.py), the loop with its
stop conditions (loop.py), the answers on each route (formats.py), OpenAI's API mapped onto
the request and its answers (openai.py) and the archive's chat template (chat.py). handlers/generating.py
serves it for the worker."""
