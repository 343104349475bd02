"""det-local's test suite: folders mirror the package (README.md, "How tests are laid out")."""
