"""The graders of the exercises, one module per chapter (named after exercises/chNN_*.py).

labkit.graders.check maps each exercise name to its grader here and grades with it.
"""
