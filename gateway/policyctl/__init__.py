"""`sluice policy ...`: the commands that check, print, diff and ship policy files, locally
(`commands`) and against a running gateway's admin API (`remote`)."""
