"""Demo assets that ralmspec builds itself: the pydocs corpus, its questions, the
small generator trained on it, and the tiny test fixtures.

Every asset under ``assets/`` is reproducible with the scripts in this package:

- ``python -m cluster.assets.build_corpus``    -> ``assets/corpus/pydocs.jsonl.gz``
- ``python -m cluster.assets.build_questions`` -> ``assets/questions/pydocs-questions.jsonl``
- ``python -m cluster.assets.train_generator`` -> ``assets/model/pydocs-gpt/``
- ``python -m cluster.assets.make_fixtures``   -> ``tests/data/fixture_*.jsonl``
"""
