"""engine.text: text in and out of the engine, torch-free (the router tokenizes with it).

Pieces (each module's docstring is its design note):
- tokenizer.py      Tokenizer and IncrementalDetokenizer for HF checkpoint directories, without transformers
- chat_template.py  chat templates rendered the way transformers renders them (sandboxed Jinja)
- stopping.py       stop conditions: EOS / stop token ids, stop strings, length
"""
