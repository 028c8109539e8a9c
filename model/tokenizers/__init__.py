"""Tokenizers in one place: the text tokenizer (shipped BPE or any tokenizer.json), chat
templates, the arithmetic character tokenizer and their shipped assets."""
