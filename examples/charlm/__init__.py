"""A GPT-style character-level language model on the standard library's pydoc text.

``data.load`` gives the data, ``model.gpt`` builds the target model, and ``tune.yaml`` tunes it:
``hydro tune examples/charlm/tune.yaml``.
"""
