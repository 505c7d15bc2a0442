# placeholder: written by the runtime work (issue 3)
