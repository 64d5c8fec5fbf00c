"""Loading a model and keeping what was built from it: the loaders, the model cards, the
exported and compiled artefacts and where they are kept."""
