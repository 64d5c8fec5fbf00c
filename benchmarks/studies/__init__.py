"""One question each: what a change gained, a suspect cleared, a choice measured."""
