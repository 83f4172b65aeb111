"""Reading CSV lines."""


def parse_row(line):
    """The fields of one CSV line; a quoted field may hold commas and doubled quotes."""
    fields, field, quoted, i = [], "", False, 0
    while i < len(line):
        c = line[i]
        if quoted:
            if c == '"':
                quoted = False
            else:
                field += c
        elif c == '"':
            quoted = True
        elif c == ",":
            fields.append(field)
            field = ""
        else:
            field += c
        i += 1
    fields.append(field)
    return fields
