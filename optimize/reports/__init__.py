"""What a run reports: the console report (console), the CI files report.md and junit.xml (ci), and
the comparison of many artifacts in one table (compare, `python -m optimize.reports.compare`)."""
