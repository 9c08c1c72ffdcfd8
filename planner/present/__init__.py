"""What people read: plans as tables (`report`), explanations (`explain`), plan diffs (`diff`),
logical axis rules (`logical_axes`), the mesh ranking (`ranking`) and the HTML report
(`html_report`). Built on the core and imported by the command line only; nothing in the core
imports it."""
