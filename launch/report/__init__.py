"""`simloop report`: read a run directory (`rundir`), draw SVG charts (`charts`), and write one
self-contained `report.html` (`page`)."""
