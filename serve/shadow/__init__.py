"""Shadow traffic: a candidate artifact served beside the one that answers, every request also sent to
it and compared with the gate's measures (traffic), the candidate itself (candidate), and the report
folder (report)."""
