"""The deterministic sample corpus ``pipeline-assets sample-data`` writes: sft records from
docstring prose (``corpus``) or generated text that scales to millions of records
(``markov_corpus``, ``markov_text``), preference pairs (``preferences``) and conversations
(``conversations``), with duplicates, contamination and junk injected at known rates."""
