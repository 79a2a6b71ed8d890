"""Code the stage scripts share. A stage script imports from here, never from another stage script
(tests/test_imports.py checks it); a stage that needs another stage's work runs it as a program."""
