"""The ground floor every layer stands on: one-line errors and exit codes, durations, progress bars,
`BENCHTRAIN_HOME`, atomic writes. Imports nothing of ours."""
