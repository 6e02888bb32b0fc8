"""The colab/ notebooks' cell sources, one module per notebook, and the cells they
share (:mod:`cells`); ``scripts/make_notebooks.py`` writes them out."""
