"""What btjit knows of the machine it runs on: its cache dir (cachedir.py) and its thread pools (threads.py).
The bottom layer: imports nothing else of btjit."""
